"""Remote engines: an OpenAI-compatible endpoint (vLLM, SGLang, llama.cpp's server, TGI, ...)
run and measured the way local methods are.

A run streams one completion (server-sent events), timing every chunk as it arrives: time to
first token, inter-token latency, tokens per second. Speculative decoding is read from each
engine's own documented surface, where it has one:

- **vLLM**: its Prometheus counters ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
  ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (label ``position``),
  read from ``/metrics`` before and after the run; the difference is this run's (on a server
  nobody else uses at the time).
- **SGLang**: the gauges ``sglang:spec_accept_length`` and ``sglang:spec_accept_rate`` from
  ``/metrics`` after the run (the server's recent average).
- **llama.cpp's server**: ``timings.draft_n`` and ``timings.draft_n_accepted`` in the response.

Where an engine exposes none of these, the run says so (``spec_source`` is None). An API key
is sent only where the endpoint has one of its own: the environment variable its ``key-env=``
names, or the OS keyring entry for its URL (service ``specplay``, user = the base URL); never
over plain http:// to another machine, and never written to a record, a log or the history.

May import: the helpers in ``specplay.core``, :mod:`specplay.core.decoding` and :mod:`specplay.core.records`.
"""
