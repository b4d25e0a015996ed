"""The catalog: what is served (models and their revisions) and the render sidecar's configuration."""
