"""globalloader: a fast, resumable data loader that shares loading across training jobs."""
