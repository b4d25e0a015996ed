"""``import_render_config``: load the RFC's render_config JSON into the render config."""
