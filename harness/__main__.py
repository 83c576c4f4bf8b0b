import signal
import sys

from harness.cli import main

# A listing piped into `head` ends quietly when the reader has had enough, as other Unix tools do.
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
sys.exit(main())
