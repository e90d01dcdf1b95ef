"""measure/: figures over many prompts and runs, pure Python (torch only inside the STS fit).

- metrics.py      `GenerationStats` of prompts -> `Summary` (tau, acceptance, calibration, timings)
- evaluation.py   `dspark eval`: prompt sets, the run file, intervals, compare, prompts shared across ranks
- run_file.py     a run file read back as input: bounded, its schema checked key by key (`read_run_document`)
- calibration.py  `dspark calibrate`: Sequential Temperature Scaling of the confidences, the engines' STS file
- replay.py       `dspark plan`: recorded rounds re-scored for other verify lengths and thresholds, tokens/s
- costs.py        the step-cost tables of SGLang, TensorRT-LLM and `bench verify`, checked as input
- schedule.py     `dspark plan --concurrency`: the engines' batch verify schedulers over recorded rounds
What a round is (`RoundRecord`, `scored_length`) lives below both this folder and decode/, in rounds.py.
"""
