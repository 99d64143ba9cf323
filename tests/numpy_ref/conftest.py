from . import fd


def pytest_terminal_summary(terminalreporter):
    if fd.WORST:
        terminalreporter.section("worst finite-difference relative error per function (float64)")
        for name, err in sorted(fd.WORST.items()):
            terminalreporter.write_line(f"{name:40s} {err:.2e}")
