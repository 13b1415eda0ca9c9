"""globalloader.ray."""
