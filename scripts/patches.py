"""Apply, check and revert the source patches.

The same command as `mok patch apply|check|revert`; the code is mok_plugin/patching.py.
"""

from mok_plugin.patching import main

if __name__ == "__main__":
    raise SystemExit(main())
