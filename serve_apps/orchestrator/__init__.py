"""Session logic of the agent orchestrator: models, cache-first prompts, tools, compression, store.

Pure Python plus Redis: no Ray and no engine here. The Serve deployment wraps
these modules; everything below can be tested without a cluster.
"""
