"""Kubernetes for a Pathways job with mtc: ``mtc manifests render`` builds the JobSet
(``manifests``, from ``options`` checked by ``plan``, the image tags from ``images`` and the
documents from ``render``) and ``mtc manifests check`` checks a hand-edited one (``check``,
against the CRD schemas in ``schemas/``). ``image_versions.json`` holds the versions of the images
``images/build.py`` builds (written with its lock), which name the tags a render uses."""
