"""What the head and the sidecars must agree on: config, formats, versions, errors."""
