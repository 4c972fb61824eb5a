"""Clients of the servers the project talks to, under one set of rules for external calls
(timeouts, bounded retries with backoff, keys from the environment, bounds on requests in flight):
the JSON-over-HTTP base (:mod:`.http`), OpenAI-compatible servers (:mod:`.openai`) and the
project's Triton models over KServe v2 (:mod:`.kserve`). Low in the tree: tools, rewards,
engines, evaluation and serving all use them."""
