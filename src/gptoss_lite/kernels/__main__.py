"""`python -m gptoss_lite.kernels`: which path each native kernel takes on this machine (`report`)."""

from gptoss_lite.kernels import report

if __name__ == "__main__":  # importing this module (as the package's tests import every module) prints nothing
    for key, value in report().items():
        print(f"{key:>10}  {value}")
