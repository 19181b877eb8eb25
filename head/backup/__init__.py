"""The backup tier, head side: when a backup is due and who uploads what (``plan``), one backup at
a time in the background (``runner``), the scrub of the stored backups (``scrub``), and the
listing a restore's choice reads (``listing``). The sidecars upload, fetch and hash."""
