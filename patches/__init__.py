"""One module per patch; patch_dsv4.patching.registry discovers them by walking this package."""
