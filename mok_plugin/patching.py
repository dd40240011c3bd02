"""Apply, check and revert mok_plugin's source patches on an installed framework package.

    mok patch apply megatron            # the installed megatron-core
    mok patch check megatron            # exit 0 when applied, 1 when not
    mok patch revert megatron
    mok patch apply megatron --target /path/to/site-packages-copy
(`python scripts/patches.py ...` is the same command.)

What each patch does:
  megatron  (megatron-core 0.19.x) `--moe-token-dispatcher-type mok` becomes a stock choice: the
            TransformerConfig Literal gains "mok", and MoELayer builds mok_plugin's MoKMoELayer
            when the config asks for it, wherever the stock layer would be built.
  deepspeed (deepspeed 0.19.x) `deepspeed.moe.layer.MoE` builds mok_plugin's MoE when a ds_config
            with "mok": {"enabled": true} is active: mok_plugin.deepspeed.apply(ds_config), or the
            file named by the MOK_DEEPSPEED_CONFIG environment variable.

Apply and revert are idempotent (applying twice, or reverting an unpatched package, changes
nothing and says so). A package of another version is refused before anything is written, with
`--target DIR` too: the version is read from DIR's package metadata (`<dist>-<version>.dist-info`)
or, for a bare copy of the package, its version file (megatron/core/package_info.py,
deepspeed/git_version_info_installed.py, or a DeepSpeed checkout's version.txt); a DIR whose
version cannot be found is refused as well. Patches are applied with `git apply` in the directory
that holds the package. The patch files are read from the checkout's patches/ folder (this package
is installed editable).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PATCH_DIR", "PATCH_SETS", "PatchSet", "main", "status", "target_version"]

PATCH_DIR = Path(__file__).resolve().parents[1] / "patches"


@dataclass(frozen=True, slots=True)
class PatchSet:
    """The patches of one framework and how to find and version-check the package they patch."""

    distribution: str  # the PyPI name, for the version check
    module: str  # the top-level import whose parent directory is the patch root
    version_prefix: str
    files: tuple[str, ...]
    # Version files relative to the patch root, read (never imported) when there is no dist-info.
    version_files: tuple[str, ...] = ()


PATCH_SETS = {
    "megatron": PatchSet(
        "megatron-core", "megatron", "0.19.", ("megatron-core-0.19-moe-token-dispatcher-type-mok.patch",),
        ("megatron/core/package_info.py",),
    ),
    "deepspeed": PatchSet(
        "deepspeed", "deepspeed", "0.19.", ("deepspeed-0.19-mok-config.patch",),
        ("deepspeed/git_version_info_installed.py", "version.txt"),
    ),
}  # fmt: skip


def _version_from_file(path: Path) -> str | None:
    """The version a package's version file states, parsed as text (importing it could run code)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.name == "version.txt":
        return text.strip() or None
    if path.name == "package_info.py":  # megatron-core: MAJOR = 0 / MINOR = 19 / PATCH = 2 / PRE_RELEASE = ""
        parts = {k: re.search(rf"^{k}\s*=\s*['\"]?([^'\"\s]*)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
        if not all(parts.values()):
            return None
        pre = re.search(r"^PRE_RELEASE\s*=\s*['\"]([^'\"]*)['\"]", text, re.M)
        return ".".join(parts[k].group(1) for k in ("MAJOR", "MINOR", "PATCH")) + (pre.group(1) if pre else "")
    found = re.search(r"^version\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def target_version(patch_set: PatchSet, root: Path) -> tuple[str | None, str]:
    """(version, where it was read) of the package in `root`; (None, what was looked for) if none."""
    for dist in importlib.metadata.distributions(path=[str(root)]):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == patch_set.distribution:
            return dist.version, str(getattr(dist, "_path", root))  # the .dist-info directory
    for name in patch_set.version_files:
        path = root / name
        if path.is_file():
            version = _version_from_file(path)
            if version:
                return version, str(path)
    looked = ", ".join([f"{patch_set.distribution.replace('-', '_')}-*.dist-info", *patch_set.version_files])
    return None, f"none of {looked} in {root}"


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


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok patch` (and scripts/patches.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("action", choices=["apply", "check", "revert"])
    parser.add_argument("framework", choices=sorted(PATCH_SETS))
    parser.add_argument("--target", type=Path, default=None, help="directory holding the package (default: installed)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Apply, check or revert; 0 on success (check: applied), 1 on failure (check: not applied),
    2 when the package is missing or of another version."""
    args = build_parser(prog).parse_args(argv)
    patch_set = PATCH_SETS[args.framework]
    if args.target is None:
        try:
            version = importlib.metadata.version(patch_set.distribution)
        except importlib.metadata.PackageNotFoundError:
            print(f"{patch_set.distribution} is not installed (pip install it first)", file=sys.stderr)
            return 2
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
        version, where = target_version(patch_set, root)
        if version is None:
            print(f"--target {root}: cannot tell which {patch_set.distribution} version it holds ({where}); "
                  f"these patches are for {patch_set.version_prefix}x", file=sys.stderr)  # fmt: skip
            return 2
        if not version.startswith(patch_set.version_prefix):
            print(f"--target {root} holds {patch_set.distribution} {version} (from {where}); these patches are "
                  f"for {patch_set.version_prefix}x", file=sys.stderr)  # fmt: skip
            return 2
    missing = [name for name in patch_set.files if not (PATCH_DIR / name).is_file()]
    if missing:
        print(f"{', '.join(missing)}: not found in {PATCH_DIR}; mok patch needs the repository's patches/ folder "
              "(an editable install, pip install -e .)", file=sys.stderr)  # fmt: skip
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
