"""Release knowledge: what is known of vLLM releases without installing or importing them.

    anchors_store   the recorded anchors of known releases (anchors/vllm-<version>.json): load, match, write
    release_target  a release to judge, from its wheel or a source tree
    release_wheel   release wheels fetched by version into a cache, and pip's bytes of installed files from them

May import: patch_dsv4.fastpath, patch_dsv4.patching, patch_dsv4.tree, patch_dsv4.output.
"""
