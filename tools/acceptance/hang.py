"""A part that hangs (tests of the deadline: `--inject-hang PART` runs this in PART's place).

It starts a child that sleeps (a stand-in for a trainer a test started), ignores SIGTERM, and sleeps: only the
deadline's SIGKILL to the whole process group ends them both.
"""

import signal
import subprocess
import sys
import time

if __name__ == "__main__":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("hanging on purpose (--inject-hang)", flush=True)
    while True:
        time.sleep(60)
