"""`kvpilot serve --replicas N` on Ray Serve: engine replicas behind kvpilot's router.

Needs the ``fleet`` extra (``pip install 'kvpilot[fleet]'``: Ray Serve). See
`kvpilot.fleet.serve.deploy` for the layout and docs/architecture.md for why the router is
an ingress deployment rather than a Ray Serve request router.
"""
