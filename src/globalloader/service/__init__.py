"""globalloader.service."""
