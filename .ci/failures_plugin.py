"""pytest plugin for GPU calls (`-p failures_plugin` with .ci on PYTHONPATH): writes each failure's
traceback to $OUT/failures.txt as it happens, so a run cut by its time limit still says why."""
import os


def pytest_runtest_logreport(report):
    if report.failed:
        path = os.path.join(os.environ.get("OUT", "."), "failures.txt")
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")
