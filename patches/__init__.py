"""One module per patch; patch_dsv4.registry discovers them by walking this package."""
