"""The target environment: the installed vLLM found, its files read and written safely, our state in it.

    installed       the one reader of the installed tree and our state: dist-infos, RECORD, the pin, the manifest, the
                    lock; capped reads, one line (Unreadable) for anything malformed; the standard library only
    environment     the installed vLLM (and FlashInfer), found from distribution metadata alone
    fs              file operations that stay inside the environment and never leave a file half-written
    mounts          files on another mount than site-packages' own (/proc/self/mountinfo): another tool's, never written
    hooks           start-up hooks that name vLLM (sitecustomize, usercustomize, .pth lines): read, never run
    state           what patch-dsv4 keeps there: the manifest, the backups, the lock
    manifest_rules  what a manifest may say, its paths and its fields, checked without touching the disk
    pip_index       what pip's configured index serves of a project (pip index versions)

May import: patch_dsv4.output.
"""
