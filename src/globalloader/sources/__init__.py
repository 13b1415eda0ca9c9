"""Sources: records addressable by integer index (`len(src)`, `src[i] -> dict`, `src.fingerprint`)."""
