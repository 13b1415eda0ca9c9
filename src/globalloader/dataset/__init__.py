"""globalloader.dataset."""
