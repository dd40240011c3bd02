"""Apply, check and revert mok_plugin's source patches on an installed framework package.

    python scripts/patches.py apply megatron            # the installed megatron-core
    python scripts/patches.py check megatron            # exit 0 when applied, 1 when not
    python scripts/patches.py revert megatron
    python scripts/patches.py apply megatron --target /path/to/site-packages-copy

What each patch does:
  megatron  (megatron-core 0.19.x) `--moe-token-dispatcher-type mok` becomes a stock choice: the
            TransformerConfig Literal gains "mok", and MoELayer builds mok_plugin's MoKMoELayer
            when the config asks for it, wherever the stock layer would be built.
  deepspeed (deepspeed 0.19.x) `deepspeed.moe.layer.MoE` builds mok_plugin's MoE when a ds_config
            with "mok": {"enabled": true} is active: mok_plugin.deepspeed.apply(ds_config), or the
            file named by the MOK_DEEPSPEED_CONFIG environment variable.

Apply and revert are idempotent (applying twice, or reverting an unpatched package, changes
nothing and says so). A package of another version is refused before anything is written.
Patches are applied with `git apply` in the directory that holds the package.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parents[1] / "patches"


@dataclass(frozen=True)
class PatchSet:
    distribution: str  # the PyPI name, for the version check
    module: str  # the top-level import whose parent directory is the patch root
    version_prefix: str
    files: tuple[str, ...]


PATCH_SETS = {
    "megatron": PatchSet(
        "megatron-core", "megatron", "0.19.", ("megatron-core-0.19-moe-token-dispatcher-type-mok.patch",)
    ),
    "deepspeed": PatchSet("deepspeed", "deepspeed", "0.19.", ("deepspeed-0.19-mok-config.patch",)),
}


def installed_root(patch_set: PatchSet) -> Path:
    """The directory holding the installed package (its site-packages)."""
    spec = importlib.util.find_spec(patch_set.module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{patch_set.distribution} is not installed (pip install it first)")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _git_apply(root: Path, patch: Path, *flags: str) -> bool:
    run = subprocess.run(["git", "apply", "-p1", *flags, str(patch)], cwd=root, capture_output=True, text=True)
    return run.returncode == 0


def status(root: Path, patch: Path) -> str:
    """ "applied", "not applied", or "does not apply" (the files differ from what the patch expects)."""
    if _git_apply(root, patch, "--check", "--reverse"):
        return "applied"
    if _git_apply(root, patch, "--check"):
        return "not applied"
    return "does not apply"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["apply", "check", "revert"])
    parser.add_argument("framework", choices=sorted(PATCH_SETS))
    parser.add_argument("--target", type=Path, default=None, help="directory holding the package (default: installed)")
    args = parser.parse_args(argv)
    patch_set = PATCH_SETS[args.framework]
    if args.target is None:
        version = importlib.metadata.version(patch_set.distribution)
        if not version.startswith(patch_set.version_prefix):
            print(f"{patch_set.distribution} {version} is installed; these patches are for "
                  f"{patch_set.version_prefix}x", file=sys.stderr)  # fmt: skip
            return 2
        root = installed_root(patch_set)
    else:
        root = args.target
        if not (root / patch_set.module).is_dir():
            print(f"--target {root} holds no {patch_set.module}/ package", file=sys.stderr)
            return 2
    failed = False
    for name in patch_set.files:
        patch = PATCH_DIR / name
        state = status(root, patch)
        if state == "does not apply":
            print(f"{name}: does not apply to {root} (modified files or another version)", file=sys.stderr)
            failed = True
        elif args.action == "check":
            print(f"{name}: {state} in {root}")
            failed |= state != "applied"
        elif args.action == "apply" and state == "not applied":
            failed |= not _git_apply(root, patch)
            print(f"{name}: applied to {root}")
        elif args.action == "revert" and state == "applied":
            failed |= not _git_apply(root, patch, "--reverse")
            print(f"{name}: reverted in {root}")
        else:
            print(f"{name}: already {'applied' if args.action == 'apply' else 'not applied'} in {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
