"""decode/: speculative decoding of one prompt, and the measurements around it.

- speculative.py  `speculative_generate`: prefill, then rounds of draft -> score -> accept -> commit -> advance;
                  `autoregressive_generate`, the plain baseline
- markov.py       the sequential Markov stage: one walk, a bias function per strategy
- sampling.py     `SamplingParams`, processed logits, lossless acceptance (greedy and rejection sampling)
- metrics.py      `RoundRecord` / `GenerationStats` -> `Summary` (tau, acceptance, calibration, timings)
- timing.py       `SectionTimer`: ms per named step of a round
- chat.py         prompt -> token ids, chat templates rendered with bounded cost
- evaluation.py   `dspark eval`: prompt sets, the run file, intervals, compare, prompts shared across ranks
- run_file.py     a run file read back as input: bounded, its schema checked key by key (`read_run_document`)
- calibration.py  `dspark calibrate`: Sequential Temperature Scaling of the confidences, the engines' STS file
- replay.py       `dspark plan`: recorded rounds re-scored for other verify lengths and thresholds, tokens/s
The public way in is `dspark_cli.runtime.pair.Pair`.
"""
