"""The peer tier, head side: where a step's copies go and which pulls make them (``plan``, values),
and the background loop that brings every committed step to its copies (``loop``). The sidecars
pull from each other."""
