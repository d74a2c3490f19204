"""Suite-wide settings: one torch thread per test process (tiny models gain nothing from more, and on a 2-core CI box
thread contention between the test and the worker processes it spawns costs far more than it gives)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the worker processes tests spawn
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

import torch  # noqa: E402

torch.set_num_threads(1)


def default_sigint() -> None:
    """preexec_fn for subprocesses a test will Ctrl-C: a shell that starts a job in the background (`cmd &`, as CI
    runners may) leaves SIGINT ignored, and Python then installs no KeyboardInterrupt handler in the child."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
