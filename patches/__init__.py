"""One module per patch; patcher.registry discovers them by walking this package."""
