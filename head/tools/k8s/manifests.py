"""Kubernetes manifests for a Pathways job that checkpoints with mtc (README, "Kubernetes (JobSet)").

``render_documents(options)`` (a ``ManifestOptions`` of ``options``, checked by ``plan``, its
documents built by ``render``) gives, as plain dicts, what ``kubectl apply -f`` needs:

- a ``Secret`` holding the peer token (unless ``peer_token_secret`` names an existing one);
- a ``JobSet`` (``jobset.x-k8s.io/v1alpha2``) shaped like the ones PathwaysJob and Cluster
  Toolkit create: a ``pathways-head`` job (Pathways resource manager and proxy as native
  sidecars, and the user's training command with the MaxText multi-tier flags), and a
  ``worker`` job per slice (the Pathways worker on the TPUs, and the colocated Python sidecar
  running the mtc colocated sidecar image: Google's colocated Python server with mtc in it).

Decisions worth knowing:

- The ramdisk is mounted at ``local_checkpoint_directory`` in the colocated Python sidecar
  only: that is the process that writes, replicates and backs up checkpoints. The head runs
  on a CPU node and never touches a ramdisk; the Pathways worker binary does not either.
- The sidecar gets the token from the Secret (``MTC_PEER_TOKEN`` via ``secretKeyRef``); the
  token never appears in the JobSet, and the head does not get it at all.
- TLS in transit is on unless ``tls`` is false (``--no-tls``): the head and the sidecars mount
  the Secret ``<name>-mtc-tls`` (keys ``ca.crt``, ``tls.crt``, ``tls.key``) at ``/etc/mtc/tls``
  and read it through ``MTC_TLS_DIR``. It is not rendered (it holds a private key): make it
  beforehand with ``mtc tls generate DIR`` and ``kubectl create secret generic``.
- MaxText flags may be written in ``--command`` (as the guide does) or given as render
  options; a flag given both ways with different values is an error, never a silent choice.
  mtc's own settings (``peer_port``) go to the head as ``MTC_*`` environment variables, so
  that MaxText's flag parser never sees a key it does not know.
- Everything here is pure: the same options give the same documents. The one exception is
  a token generated when none is given (``with_peer_token``). YAML is produced at the edge
  (``to_yaml``), and needs PyYAML (``pip install 'mtc[k8s]'``).

Error messages name the ``mtc manifests render`` flag to change.
"""

from __future__ import annotations

import dataclasses
import secrets

from mtc.shared.errors import ConfigError

from mtc.head.tools.k8s.options import ManifestOptions
from mtc.head.tools.k8s.plan import plan
from mtc.head.tools.k8s.render import jobset, pod_monitoring, secret

__all__ = ["render_documents", "to_yaml", "with_peer_token"]


def with_peer_token(options: ManifestOptions) -> ManifestOptions:
    """``options`` with a fresh random token when it needs a Secret and has no token."""
    if options.peer_token or options.peer_token_secret:
        return options
    return dataclasses.replace(options, peer_token=secrets.token_hex(32))


def render_documents(options: ManifestOptions) -> list[dict]:
    """The Secret (when one is rendered) and the JobSet, as dicts, in ``kubectl apply`` order.

    Raises ConfigError when the options are inconsistent, or when a Secret is to be rendered
    and ``options.peer_token`` is empty (call ``with_peer_token`` first to generate one).
    """
    p = plan(options)
    docs: list[dict] = []
    if not options.peer_token_secret:
        if not options.peer_token:
            raise ConfigError("no peer token to put in the Secret: pass one (--peer-token-file), "
                              "reference an existing Secret (--peer-token-secret), or let "
                              "with_peer_token() generate one")
        docs.append(secret(p))
    docs.append(jobset(p))
    if options.metrics_port:
        docs.append(pod_monitoring(p))
    return docs


def to_yaml(documents: list[dict]) -> str:
    """Multi-document YAML, keys in build order (readable, and stable between runs)."""
    try:
        import yaml
    except ImportError as e:
        raise ImportError("rendering manifests needs PyYAML: pip install 'mtc[k8s]'") from e
    return yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False, width=100)
