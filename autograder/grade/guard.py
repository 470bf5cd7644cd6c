"""The in-kernel half of the tamper defense. Runs INSIDE the sandboxed kernel, once, at start-up,
before any cell (ipykernel's `--IPKernelApp.exec_files`, from a read-only mount).

Student code shares the kernel with the hidden tests, so it can replace what the tests call:
`builtins.abs = ...`, `torch.allclose = lambda *a, **k: True`, `course.load_model = ...`, a test
helper such as `make_prompt`, IPython's own `run_cell`. Here, before any student code exists:

- snapshot (by identity) the callables, classes and submodules of the modules tests use
  (builtins, math, inspect, numpy, torch and its nn/functional/testing, course, ...), the class
  dictionaries of torch.Tensor, torch.nn.Module and course.expect.Cases (partial credit), and
  IPython's shell and kernel classes;
- swap those modules' class for a subclass whose __setattr__/__delattr__ logs writes: a patch
  that undoes itself before anyone looks (`torch.equal = fake; ...; torch.equal = real`) still
  leaves a log entry;
- an audit hook (which Python never lets anyone remove) logs what no grading needs: subprocesses,
  forks, network, ctypes, gc crawling, new audit hooks.

The grader (autograder/grade/execute.py) then drives it between cells, out of band (silent
execute requests, not IPython event hooks, which student code could unregister):
`pre`  before each locked or test cell: put every snapshotted object back, report what differed;
`post` after every cell: report what differs now and what the logs caught during the cell;
       after locked and test cells, also remember the helpers they defined (names from the grader).
Replies are signed with a key read from a file that is deleted at start, and numbered, so a
replaced or replayed guard shows up as `guard-broken`. Limits (see tamper.py): code that studies
this file can still find the key in memory or write through `__dict__`; the static scan flags
the tools that takes.
"""


def _install():  # everything stays inside this function: one name in the user namespace, deleted at the end
    import hashlib
    import hmac
    import importlib
    import json
    import os
    import sys
    import threading
    import types

    name = os.environ.pop("COURSE_GRADER_GUARD", "")
    key_file = os.environ.pop("COURSE_GRADER_KEY", "")
    if not name or not key_file:
        return
    with open(key_file, "rb") as f:
        key = f.read()
    os.remove(key_file)

    missing = object()
    eager = ["builtins", "math", "operator", "inspect", "functools", "itertools", "collections",
             "dataclasses", "copy", "numpy", "numpy.testing", "torch", "torch.nn", "torch.nn.functional",
             "torch.testing", "torch.linalg", "course", "course.expect", "course.engine"]   # the tests' checks and references
    ignored = {"builtins": {"_", "__", "___", "get_ipython", "display", "exit", "quit", "__IPYTHON__",
                            "__IPYTHON__active", "dreload", "help", "copyright", "credits", "license",
                            "input", "raw_input"}}   # ipykernel rebinds input() for every request
    modules = {}      # module name -> (module, {attr: pristine object})
    classes = {}      # label -> (class, {attr: pristine object})
    helpers = {}      # user-namespace name -> object a locked or test cell left there
    objects = {}      # user-namespace name -> (object, {method name: function set on the object itself})
    aliases = {}      # user-namespace name -> (module, attr or None), from the source's imports
    log = []          # (what, detail) caught by the write log and the audit hook since the last report
    state = {"seq": 0, "busy": False, "threads": {t.ident for t in threading.enumerate()}}

    roots = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix)}
                  | {os.path.dirname(os.path.dirname(os.path.realpath(m.__file__))) + os.sep
                     for m in (sys.modules.get("course"),) if m is not None and getattr(m, "__file__", None)})
    snapped_ids = set()   # ids of every snapshotted object: a swap (torch.allclose = torch.equal) is never "library-made"

    def library_made(value):
        """Made by installed library code, not by the notebook: libraries patch torch too
        (transformers adds nn.Module.smart_apply); such changes are adopted, not reported."""
        if id(value) in snapped_ids:
            return False
        if isinstance(value, types.MethodType):
            value = value.__func__
        if isinstance(value, types.FunctionType):
            return os.path.realpath(value.__code__.co_filename).startswith(roots)
        if isinstance(value, types.BuiltinFunctionType):
            return True
        if isinstance(value, type):
            mod = sys.modules.get(value.__module__)
            return bool(mod is not None and getattr(mod, "__file__", None)
                        and os.path.realpath(mod.__file__).startswith(roots))
        return False

    def interesting(value):
        return callable(value) or isinstance(value, (type, types.ModuleType))

    def foreign(value):
        """A function or class defined in the notebook itself (its __module__ is '__main__')."""
        return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__"

    class Watched(types.ModuleType):
        """A guarded module: writes to snapshotted names are logged (reads are not slowed down)."""

        def __setattr__(self, attr, value):
            snap = modules.get(types.ModuleType.__getattribute__(self, "__name__"), (None, {}))[1]
            if not state["busy"] and attr in snap and snap[attr] is not value and not library_made(value):
                log.append(("write", f"{self.__name__}.{attr}"))
            types.ModuleType.__setattr__(self, attr, value)

        def __delattr__(self, attr):
            snap = modules.get(types.ModuleType.__getattribute__(self, "__name__"), (None, {}))[1]
            if not state["busy"] and attr in snap:
                log.append(("write", f"del {self.__name__}.{attr}"))
            types.ModuleType.__delattr__(self, attr)

    Watched.__module__ = "course_grader_guard"

    def snapshot_module(mod_name, found):
        mod = sys.modules.get(mod_name)
        if mod is None or mod_name in modules:
            return
        skip = ignored.get(mod_name, set())
        snap = {}
        for attr, value in list(vars(mod).items()):
            if attr in skip or not interesting(value):
                continue
            if foreign(value):           # first seen already patched (lazily imported modules)
                found.append(f"{mod_name}.{attr} (defined in the notebook)")
                continue
            snap[attr] = value
        modules[mod_name] = (mod, snap)
        if type(mod) is types.ModuleType:
            try:
                mod.__class__ = Watched
            except TypeError:
                pass

    def snapshot_class(label, cls):
        skip = {"__doc__", "__dict__", "__weakref__", "__module__", "__annotations__"}
        classes[label] = (cls, {a: v for a, v in vars(cls).items() if a not in skip})

    for mod_name in eager:
        try:
            importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - a course without numpy or torch still gets the rest
            continue
    engine = sys.modules.get("course.engine")      # the references tests grade against: all of them, before any cell
    for info in __import__("pkgutil").iter_modules(getattr(engine, "__path__", [])):
        try:
            importlib.import_module(f"course.engine.{info.name}")
        except Exception:  # noqa: BLE001 - an optional engine part that cannot load here
            continue
    startup_found = []
    for mod_name in eager + sorted(m for m in sys.modules if m.startswith("course.")):
        snapshot_module(mod_name, startup_found)
    snapped_ids.update(id(v) for _, snap in modules.values() for v in snap.values())
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        snapshot_class("torch.Tensor", torch.Tensor)
        snapshot_class("torch.nn.Module", torch.nn.Module)
    expect = sys.modules.get("course.expect")
    if expect is not None and isinstance(getattr(expect, "Cases", None), type):   # partial credit's own counter
        snapshot_class("course.expect.Cases", expect.Cases)
    shell = get_ipython()  # noqa: F821 - exec_files run with IPython's namespace
    instances = {}    # label -> (object, {attr: pristine function}): IPython's shell and kernel
    for obj in (shell, getattr(shell, "kernel", None)):
        for cls in type(obj).__mro__[:-1]:
            if cls.__module__.startswith(("IPython", "ipykernel")):
                snapshot_class(f"{cls.__module__}.{cls.__qualname__}", cls)
    method_names = {a for label, (_, snap) in classes.items() if label != "torch.Tensor"
                    for a, v in snap.items() if isinstance(v, (types.FunctionType, staticmethod, classmethod))}
    functions = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)

    def shadowing(obj):
        """Instance attributes that hide a method of the class (`shell.run_cell = fake`)."""
        return {a: v for a, v in vars(obj).items() if a in method_names and isinstance(v, functions)}

    for label, obj in (("get_ipython()", shell), ("get_ipython().kernel", getattr(shell, "kernel", None))):
        instances[label] = (obj, shadowing(obj))

    watched_events = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                      "os.forkpty", "os.kill", "os.killpg", "socket.connect", "socket.bind", "ctypes.",
                      "gc.get_", "sys.addaudithook", "sys.settrace", "sys.setprofile")

    me = os.getpid()

    def audit(event, args):
        if not state["busy"] and event.startswith(watched_events):
            if event in ("os.kill", "os.killpg") and args[1] == 2 and args[0] in (me, os.getpgid(me)):
                return    # ipykernel interrupting itself (the grader's cell timeout)
            log.append(("event", event))

    sys.addaudithook(audit)

    def check(restore):
        """What differs from the snapshots; with `restore`, put the snapshots back."""
        found = []
        state["busy"] = True
        try:
            for mod_name in sorted(m for m in sys.modules if m.startswith("course.")):
                snapshot_module(mod_name, found)  # course modules a cell imported since the last check
            for mod_name, (mod, snap) in modules.items():
                if sys.modules.get(mod_name) is not mod and mod_name in sys.modules:
                    found.append(f"sys.modules[{mod_name!r}]")
                    if restore:
                        sys.modules[mod_name] = mod
                space = vars(mod)
                for attr, value in list(snap.items()):
                    now = space.get(attr, missing)
                    if now is value:
                        continue
                    if now is not missing and library_made(now):
                        snap[attr] = now          # adopted: the new normal
                        continue
                    found.append(f"{mod_name}.{attr}")
                    if restore:
                        space[attr] = value
            for label, (cls, snap) in classes.items():
                now = dict(vars(cls))
                for attr in set(now) | set(snap):
                    if attr in {"__doc__", "__dict__", "__weakref__", "__module__", "__annotations__"}:
                        continue
                    if now.get(attr, missing) is not snap.get(attr, missing):
                        if attr in now and library_made(now[attr]):
                            snap[attr] = now[attr]
                            continue
                        found.append(f"{label}.{attr}")
                        if restore:
                            if attr in snap:
                                type.__setattr__(cls, attr, snap[attr])
                            else:
                                type.__delattr__(cls, attr)
            for label, (obj, snap) in instances.items():   # a method replaced on the instance
                now = vars(obj)
                for attr in [a for a, v in shadowing(obj).items() if v is not snap.get(a, missing)]:
                    found.append(f"{label}.{attr}")
                    if restore:
                        if attr in snap:
                            now[attr] = snap[attr]
                        else:
                            del now[attr]
            for trace, setter, label in ((sys.gettrace, sys.settrace, "sys.settrace"),
                                         (sys.getprofile, sys.setprofile, "sys.setprofile")):
                if trace() is not None:
                    found.append(label)
                    if restore:
                        setter(None)
            for var, (obj, snap) in objects.items():     # hf_model.generate = my_loop
                now = own_methods(obj)
                for attr in sorted(set(now) | set(snap)):
                    if now.get(attr, missing) is not snap.get(attr, missing):
                        found.append(f"{var}.{attr} (a method of an object the lab gave you)")
                        if restore:
                            if attr in snap:
                                vars(obj)[attr] = snap[attr]
                            else:
                                del vars(obj)[attr]
            ns = shell.user_ns
            for var, value in helpers.items():
                if ns.get(var, missing) is not value:
                    found.append(f"{var} (defined by a locked or test cell)")
                    if restore:
                        ns[var] = value
            for var, (mod_name, attr) in aliases.items():
                expected = expected_alias(mod_name, attr)
                if expected is not missing and var in ns and ns[var] is not expected:
                    found.append(f"{var} (import of {mod_name}{'.' + attr if attr else ''})")
                    if restore:
                        ns[var] = expected
        finally:
            state["busy"] = False
        return found

    def own_methods(obj):
        """Callables set on the object itself that hide a method of its class."""
        try:
            space = vars(obj)
        except TypeError:
            return {}
        cls = type(obj)
        return {a: v for a, v in space.items()
                if callable(v) and isinstance(getattr(cls, a, None), (types.FunctionType, property))}

    def expected_alias(mod_name, attr):
        # What the import binds: `from pkg import name` reads pkg.name first (the snapshot when pkg is
        # watched) and falls back to the submodule pkg.name; a package may rebind the name, as
        # course.widgets does (`from .sampling_explorer import sampling_explorer`: the function).
        if attr is None:
            return sys.modules.get(mod_name, missing)
        if mod_name in modules:
            if attr in modules[mod_name][1]:
                return modules[mod_name][1][attr]
        elif mod_name in sys.modules and hasattr(sys.modules[mod_name], attr):
            return getattr(sys.modules[mod_name], attr)
        return sys.modules.get(f"{mod_name}.{attr}", missing)

    def reply(body):
        state["seq"] += 1
        body["seq"] = state["seq"]
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": text, "sig": hmac.new(key, text.encode(), hashlib.sha256).hexdigest()})

    def call(op, args_json="{}"):
        args = json.loads(args_json)
        if op == "config":
            aliases.update({k: tuple(v) for k, v in args.get("aliases", {}).items()})
            return reply({"found": startup_found, "log": []})
        for var in args.get("bound", []):     # a test or locked cell may redefine its own helpers
            helpers.pop(var, None)
            objects.pop(var, None)
        found = check(restore=(op == "pre"))
        caught = sorted(set(f"{what}: {detail}" for what, detail in log))
        log.clear()
        threads = [t for t in threading.enumerate() if t.ident not in state["threads"]]
        state["threads"].update(t.ident for t in threads)
        threads = [t for t in threads if not library_made(getattr(t, "_target", None) or type(t))]
        if op == "post":  # remember what a locked cell (any value) or a test cell (functions) defined
            ns = shell.user_ns
            for var in args.get("names", []):
                if var in ns:
                    helpers[var] = ns[var]
            for var in args.get("callables", []):
                if var in ns and interesting(ns[var]):
                    helpers[var] = ns[var]
            for var in args.get("objects", []):
                if var in ns and not isinstance(ns[var], (type, types.ModuleType, types.FunctionType)):
                    helpers[var] = ns[var]
                    objects[var] = (ns[var], own_methods(ns[var]))
        return reply({"found": found, "log": caught, "threads": [t.name for t in threads]})

    guard = types.ModuleType(name)
    guard._call = call
    sys.modules[name] = guard


_install()
del _install
