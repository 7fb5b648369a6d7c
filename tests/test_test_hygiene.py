"""The suite's own hygiene, checked by reading its source (``ast``), no MPI:

- no ``time.sleep`` orders events: a sleep inside a ``while`` loop is a poll
  interval (the loop waits for a condition) and passes; any other must be in
  :data:`ALLOWED_SLEEPS` with the reason it is part of what is tested (a peer
  that stalls on purpose, a thread that plays a blocked caller, a window in
  which nothing may happen).  An entry whose function no longer sleeps fails
  too, so the list stays true.  Code in string literals (scripts the tests run
  as subprocesses) is read as well;
- no wall-clock assertion under 1 s: an ``assert`` comparing an elapsed time
  (a ``time.monotonic``/``time.time``/``time.perf_counter`` difference, or a
  name assigned from one, or named ``dt``/``took``/``elapsed``/``wall``) with
  ``<`` or ``<=`` against a number below 1.0.  Bounds that guard "bounded, no
  hang" are >= 1 s and derived from the configured timeout; speed belongs in
  benchmarks/.  Lower bounds (a deadline honoured) are not checked.

Run as a script (``python tests/test_test_hygiene.py [DIR]``) it prints the
inventory.
"""
import ast
import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parent

#: (file, function) -> why its sleep is part of what is tested, not an ordering.
ALLOWED_SLEEPS = {
    ("ft_worker.py", "die"): "a victim that stalls on purpose (how='stall'): the survivors' timeout is tested",
    ("test_ft.py", "revoke"): "a stub revoke that blocks for ever (the wedged-MPI shape)",
    ("test_ft.py", "test_watchdog_soft_deadline_revokes"):
        "a window past timeout + grace (1.2 s) in which the disarmed watchdog must not fail the rank",
    ("test_ft.py", "test_watchdog_disarm_in_time_does_nothing"):
        "a window past the last deadline in which nothing may happen",
    ("test_ft.py", "test_watchdog_fails_an_idle_process_early_in_the_shrink"):
        "the caller idles in 'agree' on purpose: the watchdog must leave it alone there",
    ("test_ft.py", "test_watchdog_leaves_a_polling_process_in_the_shrink_alone"):
        "the attempt's thread blocks on purpose: the watchdog must not fail it before the bound",
    ("test_ft.py", "<string>"): "the fail-stop script's caller stuck in a sleep (a C call that released the GIL)",
    ("test_halo_node.py", "test_ghosts_hold_the_neighbours_cells_of_the_right_step_under_random_delays"):
        "random stalls put ranks out of step (one ahead, one behind): the mailbox protocol must hold either way",
    ("test_ft_dup_after_death.py", "<module>"):
        "each survivor calls dup at a drawn delay after the death: where the failure lands in the "
        "duplication is the test",
    ("test_tcp.py", "setter"): "set() calls at drawn delays race the waiters: the interleavings are the test",
    ("test_tcp.py", "test_connection_reader_survives_a_writer_with_timeouts"):
        "pacing of a stress loop so the reader blocks in recv at times; no outcome depends on it",
    ("test_elastic.py", "test_heartbeat_survives_a_starved_master"):
        "the master process is stopped (SIGSTOP) for 3 s past its heartbeat timeout on purpose, then a "
        "window in which its monitor must not drop live peers",
    ("test_elastic.py", "joiner"): "a join at a drawn delay (from the suite's seed) races votes and calls",
    ("test_elastic_engine.py", "steps"): "a member late by a drawn 1.5-2 s on purpose: its peers' timeout (1 s) fires",
}

SLEEP_LIMIT = 1.0          # seconds: a wall-clock bound below this is a speed check
TIME_CALLS = {"monotonic", "time", "perf_counter", "monotonic_ns", "perf_counter_ns"}
TIME_NAMES = {"dt", "took", "elapsed", "wall"}


def _is_sleep(node) -> bool:
    f = node.func
    return ((isinstance(f, ast.Attribute) and f.attr == "sleep" and isinstance(f.value, ast.Name)
             and f.value.id == "time") or (isinstance(f, ast.Name) and f.id == "sleep"))


def _is_time_call(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return ((isinstance(f, ast.Attribute) and f.attr in TIME_CALLS and isinstance(f.value, ast.Name)
             and f.value.id == "time") or (isinstance(f, ast.Name) and f.id in {"monotonic", "perf_counter"}))


def _number(node):
    """The value of a constant numeric expression, else None."""
    try:
        if all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.expr_context))
               for n in ast.walk(node)):
            v = eval(compile(ast.Expression(node), "<n>", "eval"), {"__builtins__": {}})  # noqa: S307
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    except Exception:  # noqa: BLE001
        return None
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self, fname, timey):
        self.fname, self.timey = fname, timey
        self.stack, self.loops = ["<module>"], [False]
        self.sleeps, self.walls = [], []

    def _func(self, node):
        self.stack.append(node.name)
        self.loops.append(False)
        self.generic_visit(node)
        self.stack.pop()
        self.loops.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _func

    def visit_While(self, node):
        saved = self.loops[-1]
        self.loops[-1] = True
        self.generic_visit(node)
        self.loops[-1] = saved

    def visit_Call(self, node):
        if _is_sleep(node):
            self.sleeps.append((self.fname, self.stack[-1], node.lineno, self.loops[-1]))
        self.generic_visit(node)

    def _is_timey(self, node) -> bool:
        for n in ast.walk(node):
            if _is_time_call(n) or (isinstance(n, ast.Name) and n.id in self.timey):
                return True
            if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "elapsed":
                return True
        return False

    def visit_Assert(self, node):
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            terms = [cmp.left, *cmp.comparators]
            for (a, b), op in zip(zip(terms, terms[1:]), cmp.ops):
                if isinstance(op, (ast.Lt, ast.LtE)):
                    t, bound = a, b
                elif isinstance(op, (ast.Gt, ast.GtE)):
                    t, bound = b, a
                else:
                    continue
                v = _number(bound)
                if v is not None and v < SLEEP_LIMIT and self._is_timey(t):
                    self.walls.append((self.fname, self.stack[-1], node.lineno, ast.unparse(cmp)))
        self.generic_visit(node)


def _timey_names(tree) -> set:
    """Names assigned (or appended to) from a clock reading, transitively, plus TIME_NAMES."""
    names = set(TIME_NAMES)

    def timey(expr):
        return any(_is_time_call(n) or (isinstance(n, ast.Name) and n.id in names) for n in ast.walk(expr))

    for _ in range(4):
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and timey(n.value):
                for t in n.targets:
                    if isinstance(t, ast.Name) and not _is_time_call(n.value):
                        # t0 = time.monotonic() is a reading, not an elapsed time
                        names.add(t.id)
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append"
                  and isinstance(n.func.value, ast.Name) and n.args and timey(n.args[0])
                  and not _is_time_call(n.args[0])):
                names.add(n.func.value.id)
    return names


def scan(path: pathlib.Path):
    """``(sleeps, walls)`` of one file: sleeps as (file, function, line, in_while), walls as (file, function, line, text)."""
    tree = ast.parse(path.read_text(), str(path))
    sc = _Scan(path.name, _timey_names(tree))
    sc.visit(tree)
    for n in ast.walk(tree):  # scripts in string literals, run as subprocesses
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "sleep(" in n.value:
            try:
                sub = ast.parse(n.value)
            except SyntaxError:
                continue
            inner = _Scan(path.name, _timey_names(sub))
            inner.visit(sub)
            sc.sleeps += [(f, "<string>", n.lineno + ln - 1, loop) for f, _, ln, loop in inner.sleeps]
    return sc.sleeps, sc.walls


def inventory(root: pathlib.Path = TESTS):
    sleeps, walls = [], []
    for path in sorted(root.glob("*.py")):
        if path.name == pathlib.Path(__file__).name:
            continue  # its own examples of what is forbidden
        s, w = scan(path)
        sleeps += s
        walls += w
    return sleeps, walls


def _forbidden(sleeps):
    return [s for s in sleeps if not s[3] and (s[0], s[1]) not in ALLOWED_SLEEPS]


def test_no_sleep_orders_events():
    sleeps, _ = inventory()
    bad = _forbidden(sleeps)
    assert not bad, ("time.sleep outside a poll loop and the allow-list (order by an event, a polled condition "
                     "(tests/waiting.py) or a library hook instead; or add it to ALLOWED_SLEEPS with the reason "
                     "it is part of what is tested):\n" + "\n".join(f"  {f}:{ln} in {fn}()" for f, fn, ln, _ in bad))


def test_allow_list_is_current():
    sleeps, _ = inventory()
    used = {(f, fn) for f, fn, _, loop in sleeps if not loop}
    stale = sorted(set(ALLOWED_SLEEPS) - used)
    assert not stale, f"ALLOWED_SLEEPS entries with no sleep left (remove them): {stale}"


def test_no_wall_clock_assertion_under_a_second():
    _, walls = inventory()
    assert not walls, ("wall-clock assertions under 1 s (speed belongs in benchmarks/; a no-hang bound is >= 1 s, "
                       "derived from the configured timeout):\n" + "\n".join(
                           f"  {f}:{ln} in {fn}(): {text}" for f, fn, ln, text in walls))


def test_the_guard_bites(tmp_path):
    """The scan finds what it forbids: an ordering sleep, a sub-second bound, and
    one in a subprocess script; a poll loop's sleep and a lower bound pass."""
    (tmp_path / "test_bad.py").write_text(
        "import time, threading\n"
        "def test_x():\n"
        "    t = threading.Thread(target=print)\n"
        "    t.start()\n"
        "    time.sleep(0.3)\n"                                   # ordering: forbidden
        "    t0 = time.monotonic()\n"
        "    dt = time.monotonic() - t0\n"
        "    assert dt < 0.5\n"                                   # speed: forbidden
        "    assert time.monotonic() - t0 <= 0.25 and dt >= 0.1\n"  # forbidden; the lower bound is fine
        "    assert 0.2 <= dt < 2.0\n"                            # fine: a lower bound and a >= 1 s bound
        "    while not t.is_alive():\n"
        "        time.sleep(0.01)\n"                              # a poll interval: fine
        "SCRIPT = 'import time\\ntime.sleep(1)\\n'\n")            # a subprocess's sleep: forbidden
    sleeps, walls = inventory(tmp_path)
    assert [(fn, ln) for _, fn, ln, _ in _forbidden(sleeps)] == [("test_x", 5), ("<string>", 14)], sleeps
    assert [ln for _, _, ln, _ in walls] == [8, 9], walls


if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else TESTS
    sleeps, walls = inventory(root)
    bad = [s for s in sleeps if not s[3] and (s[0], s[1]) not in ALLOWED_SLEEPS]
    print(f"time.sleep calls: {len(sleeps)} ({sum(s[3] for s in sleeps)} poll intervals in while loops, "
          f"{len(sleeps) - sum(s[3] for s in sleeps) - len(bad)} allow-listed, {len(bad)} forbidden)")
    for f, fn, ln, _ in bad:
        print(f"  sleep {f}:{ln} {fn}()")
    print(f"wall-clock assertions under {SLEEP_LIMIT} s: {len(walls)}")
    for f, fn, ln, text in walls:
        print(f"  wall {f}:{ln} {fn}(): {text}")
