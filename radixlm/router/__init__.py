"""Data parallelism: a cache-aware router in front of several radixlm (or SGLang) servers.

  tree.py      an approximate radix tree per worker of the prompts sent there
  policy.py    cache_aware (sgl-router's policy), round_robin, shortest_queue, minimum_tokens,
               random
  keys.py      a request's routing key (text, token ids, a canonical text of chat messages)
  workers.py   the pool: load counters, health checks, removal of dead workers
  proxy.py     forwarding with SSE passthrough and retry of requests a dead worker never answered
  app.py       the HTTP front (FastAPI) and `run_router` (standalone: `radixlm router`)
  dp.py        `--dp-size N`: N replicas of the server, each a process tree, behind the router
  replica.py   a replica's entry point
  pd.py        `--pd-disaggregation`: each request to a prefill and a decode server

Nothing here imports torch: the router is an HTTP process; the workers do the computing.
"""
