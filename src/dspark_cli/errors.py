"""User-facing errors: one sentence, a documented exit code, no traceback unless --verbose."""

EXIT_OK = 0
EXIT_FINDINGS = 1  # validate found errors (or warnings with --strict)
EXIT_BAD_INPUT = 2  # an input could not be read or is unusable
EXIT_INCONCLUSIVE = 3  # bench audit found no difference, but the engine drafted or accepted nothing to test
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15), e.g. `kill`, a job scheduler or a container stop


class Terminated(BaseException):
    """Raised by the CLI's SIGTERM handler so that SIGTERM unwinds like Ctrl-C: temporary outputs are removed.

    A BaseException, like KeyboardInterrupt, so that `except Exception` blocks do not swallow it.
    """


class DsparkError(Exception):
    """An error caused by the user's input or environment, printed as one sentence.

    `message` says what is wrong, naming the file or key, and what to do about it.
    """

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


SETTING_NAMES = {"block_size": "block size", "draft_topk": "draft top-k", "markov": "Markov strategy",
                 "top_p": "top-p", "top_k": "top-k"}


class SettingError(DsparkError, ValueError):
    """A setting's value cannot be used (a ValueError too, for library callers). The runtime names the setting
    ("the block size must be ..."); the CLI words it with the flag instead (cli/options.py FLAGS): `setting` is its
    name in the library's API and `problem` the rest of the sentence."""

    def __init__(self, setting: str, problem: str):
        super().__init__(f"the {SETTING_NAMES.get(setting, setting.replace('_', ' '))} {problem}")
        self.setting = setting
        self.problem = problem
