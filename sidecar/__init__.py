"""The worker side of mtc: the tiers (RAM, peer, backup) and the sidecar service."""
