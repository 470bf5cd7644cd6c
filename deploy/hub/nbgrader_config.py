"""nbgrader's settings for STUDENTS' servers on a JupyterHub, for handing in through nbgrader's exchange.

Install it where every student's server reads it (docs/deploy.md): /etc/jupyter/nbgrader_config.py on a
Littlest JupyterHub, or baked into the single-user image (deploy/Dockerfile does). The instructor's own
settings are autograder/nbgrader_config.py plus the same course id and exchange (autograder/GUIDE.md,
section 5).

- The exchange is a folder every student can write to: $COURSE_EXCHANGE, default /srv/nbgrader/exchange.
- `path_includes_course`: nbgrader looks for a lab in ~/llm-inference/LAB/, which is where the
  course's nbgitpuller links clone it (`make links`, FOLDER = the course id), so a lab a student
  opened from a link shows up under "Downloaded assignments" with a Submit button.
- The student id is the hub's user name. nbgrader takes the Unix user name otherwise, which on Zero
  to JupyterHub is "jovyan" for everyone (nbgrader maps that one case itself) and on a hub spawning
  every user as one Unix account (the course's own test) would be the same for all.
"""
import os

c = get_config()  # noqa: F821 (injected by traitlets)

c.CourseDirectory.course_id = "llm-inference"
c.Exchange.root = os.environ.get("COURSE_EXCHANGE", "/srv/nbgrader/exchange")
c.Exchange.path_includes_course = True
if os.environ.get("JUPYTERHUB_USER"):
    c.CourseDirectory.student_id = os.environ["JUPYTERHUB_USER"]
