"""The OpenAI server on Ray Serve: engine replicas across nodes, cache-aware routing between
them (app.py: build_app; router.py: PrefixAffinityRouter). Needs `pip install 'tinypaged[ray]'`."""
