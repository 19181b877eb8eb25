"""``python -m mtc.sidecar serve ...``: one sidecar daemon; ``python -m mtc.sidecar cluster ...``:
a local cluster of them driven from stdin (``mtc.sidecar.local_cluster.serve_cluster``)."""

import sys

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "cluster":
        from mtc.sidecar.local_cluster import serve_cluster

        sys.exit(serve_cluster(sys.argv[2:]))
    from mtc.sidecar.daemon import main

    sys.exit(main())
