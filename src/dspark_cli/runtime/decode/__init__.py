"""decode/: speculative decoding of one prompt, and the measurements around it.

- speculative.py  `speculative_generate`: prefill, then rounds of draft -> score -> accept -> commit -> advance;
                  `autoregressive_generate`, the plain baseline
- markov.py       the sequential Markov stage: one walk, a bias function per strategy
- sampling.py     `SamplingParams`, processed logits, lossless acceptance (greedy and rejection sampling)
- metrics.py      `RoundRecord` / `GenerationStats` -> `Summary` (tau, acceptance, calibration, timings)
- timing.py       `SectionTimer`: ms per named step of a round
- chat.py         prompt -> token ids, chat templates rendered with bounded cost
- evaluation.py   `dspark eval`: prompt sets, the run file, intervals, compare
The public way in is `dspark_cli.runtime.pair.Pair`.
"""
