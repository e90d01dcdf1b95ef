"""bench/: the library half of `dspark bench markov`, `dspark bench verify`, `dspark bench serve` and `dspark bench
audit`.

- run.py       `run_bench`: checks, then every configuration timed (`BenchConfig`, heads from a checkpoint or random)
- inputs.py    configurations, heads, random inputs, the memory check
- walks.py     the Markov strategies of decode/markov.py as timed callables, the reference walk, the token check
- timer.py     the interleaved timer (rotated rounds, spread limit), CUDA graphs
- report.py    rows, bandwidth bounds, the report, the latency chart;  lineplot.py: a dependency-free PNG chart
- verify.py    `dspark bench verify`: the target loaded and its score pass timed for t = 1..T tokens (`verify_costs`;
               the table `dspark plan` reads), and for B requests x t tokens (`batch_verify_costs`, `--batch`)
- serve.py     `dspark bench serve`: a client for a running OpenAI-compatible engine (streamed requests in threads,
               bounded; throughput, TTFT, ITL, per-request tokens/s; `run_serve_bench`)
- quant_guard.py  convert's acceptance guard: an unquantized and a quantized GGUF draft served by llama-server beside
               one target, τ on held-out prompts with intervals, the quantized one refused past a threshold
- audit.py     `dspark bench audit`: a live engine's speculative output against its plain output and dspark's
               reference, every token at T = 0, a chi-square test of sampled tokens at T > 0 (`run_audit`);
               audit_client.py the engines' token-id APIs, audit_stats.py the test
- engine_metrics.py  what engines report about speculation: vLLM / llama.cpp Prometheus counters, SGLang's gauges
               and server info, llama.cpp's per-response timings (torch-free parsers)
"""
