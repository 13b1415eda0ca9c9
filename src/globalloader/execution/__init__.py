"""globalloader.execution."""
