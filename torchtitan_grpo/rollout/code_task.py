"""A verifiable code task: complete a Python function from its signature and
docstring (issue 52's GRPO run on the MoE pretrained by
``scripts/pretrain_moe.py``).

Rows (:func:`function_rows`, written by ``scripts/make_code_dataset.py`` from
the files that pretraining held out) are::

    {"prompt": <up to --context-bytes of the lines before the function> + head,
     "head": <the function's decorators, signature and docstring>,
     "answer": <the function's body after the docstring: the reference>,
     "names": <the module's top-level names, space-separated>, "id": "path:line:name"}

The prompt is raw source text (no chat template: the model is a byte-level
base model) and ends with the newline after the docstring, so the completion
starts at the body's first line. Which functions qualify: module-level
functions and methods of module-level classes (so their free names are the
module's), with a docstring on lines of its own and a body after it, the
head and the body under the byte limits (bytes are the byte tokenizer's
tokens), and a reference that :func:`code_complete` itself scores 1.0.

Nothing here imports the split of held-out files: it lives in
``scripts/pretrain_moe.py`` (a script; the package imports no script), and the
dataset builder, a script too, takes it from there.
"""

from __future__ import annotations

import ast
import builtins
import re

IMPLICIT_NAMES = frozenset(dir(builtins)) | {"__file__", "__path__", "__builtins__", "__cached__", "__class__"}
"""Names a function body may use without defining them: the builtins (of the
running Python), the module attributes every module has, and ``__class__``
(what a method's zero-argument ``super()`` reads)."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# --------------------------------------------------------------------------
# The reward
# --------------------------------------------------------------------------


def _lines(text: str) -> list[str]:
    """Lines with their ends, split where Python's tokenizer splits (``\\n``,
    ``\\r\\n``, ``\\r``, all made ``\\n``): ``str.splitlines`` also splits at form
    feeds and other separators, which would shift ``ast``'s line numbers."""
    parts = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _indent(line: str) -> int:
    """Width of a line's leading whitespace (tabs count one: a file mixing
    them fails ``ast`` anyway)."""
    return len(line) - len(line.lstrip(" \t"))


def function_text(completion: str, indent: int) -> str | None:
    """The part of ``completion`` that is the function's body: everything
    before its first non-blank line indented no deeper than the ``def``
    (``indent``), the line that dedents out of the function. Without such a
    line the function counts as finished only when the completion ends with a
    newline (the model ended the text after a whole line, as a file ends);
    otherwise it was cut by the token budget mid-line: None."""
    lines = _lines(completion)
    for i, line in enumerate(lines):
        if line.strip() and _indent(line) <= indent:
            return "".join(lines[:i])
    return completion if completion.endswith("\n") else None


def _parse_function(head: str, body: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function ``head + body`` as ``ast`` reads it, or None if it does not
    parse. An indented method parses under an ``if True:`` (any indentation
    opens a block there), so no line needs re-indenting: a multi-line string
    keeps its text."""
    source = head + body
    wrapped = _indent(head) > 0
    try:
        tree = ast.parse("if True:\n" + source if wrapped else source)
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in the text
        return None
    nodes = tree.body[0].body if wrapped else tree.body
    if len(nodes) != 1 or not isinstance(nodes[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return nodes[0]


def _trivial(stmt: ast.stmt) -> bool:
    """A statement that does nothing: ``pass``, a bare string (a docstring) or
    ``...``, or ``raise NotImplementedError[(...)]``."""
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return isinstance(stmt.value.value, str) or stmt.value.value is Ellipsis
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _bound_names(fn: ast.AST) -> set[str]:
    """Every name the function binds anywhere inside it (arguments, targets,
    imports, nested definitions, ``except ... as``, ``global``): an
    over-approximation of its locals, nested scopes merged."""
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out.update(node.names)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            out.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            out.add(node.rest)
    return out


def undefined_names(fn: ast.FunctionDef | ast.AsyncFunctionDef, known: set[str]) -> set[str]:
    """Names the body reads that are neither bound in the function, nor in
    ``known``, nor :data:`IMPLICIT_NAMES`. Only the body after the signature
    counts: decorators, annotations and defaults belong to the prompt."""
    bound = _bound_names(fn) | known | IMPLICIT_NAMES
    used = {node.id for stmt in fn.body for node in ast.walk(stmt)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return used - bound


def _arg_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}


def reads_an_argument(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """The body reads one of the function's arguments (``self`` and ``cls``
    count), or the function has none: ``return None`` or ``return 0`` under
    ``def area(self):`` does not get the reward a body that works on its
    input gets."""
    args = _arg_names(fn)
    if not args:
        return True
    return any(isinstance(node, ast.Name) and node.id in args for stmt in fn.body for node in ast.walk(stmt))


def _nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """How much the body says: its ``ast`` nodes, the docstring and other do-nothing statements left out."""
    return sum(1 for stmt in fn.body if not _trivial(stmt) for _ in ast.walk(stmt))


def hands_back_an_argument(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """The body only returns one of its arguments as it came (``return self``,
    ``return a``): it reads an argument and parses, and does nothing."""
    args = _arg_names(fn)
    work = [stmt for stmt in fn.body if not _trivial(stmt)]
    return (len(work) == 1 and isinstance(work[0], ast.Return) and isinstance(work[0].value, ast.Name)
            and work[0].value.id in args)


MIN_SHARE_OF_REFERENCE = 1 / 3
"""A body must have at least this share of the reference body's ``ast`` nodes
(when the row has its reference, ``row["answer"]``): a one-liner does not
finish a function whose own body is twenty lines."""


def code_complete(prompt: str, completion: str, row: dict) -> float:
    """1.0 iff the completion finishes the function of ``row["head"]`` with
    code that parses and does something; else 0.0. Nothing of the completion
    is executed.

    The completion is cut at its first line that dedents out of the function
    (:func:`function_text`; the rest, usually the next definition, is not
    scored); a completion that never dedents and stops mid-line was cut by
    the token budget and scores 0. Then ``head + body`` must

    * parse with ``ast`` as one function definition;
    * have a non-trivial body: at least one statement besides the docstring,
      ``pass``, ``...`` and ``raise NotImplementedError``, and a body that
      reads one of the arguments when there are any (:func:`reads_an_argument`)
      and does more than return one as it came (:func:`hands_back_an_argument`);
    * be at least :data:`MIN_SHARE_OF_REFERENCE` of the reference body's size
      in ``ast`` nodes, when the row carries it (``row["answer"]``);
    * read only names that are defined: bound in the function (its arguments
      included), builtins, the module's top-level names (``row["names"]``,
      space-separated, optional) or identifiers that appear in the prompt
      (imports and definitions in view; a lenient check, meant to catch
      invented names, not to prove the code right).
    """
    head = row.get("head")
    if not isinstance(head, str) or not head.strip():
        raise KeyError("code_complete: the row has no 'head' (the function's signature and docstring; "
                       "write rows with scripts/make_code_dataset.py)")
    body = function_text(completion, _indent(head))
    if body is None:
        return 0.0
    fn = _parse_function(head, body)
    if (fn is None or all(_trivial(stmt) for stmt in fn.body) or not reads_an_argument(fn)
            or hands_back_an_argument(fn)):
        return 0.0
    reference = _parse_function(head, row["answer"]) if isinstance(row.get("answer"), str) else None
    if reference is not None and _nodes(fn) < MIN_SHARE_OF_REFERENCE * _nodes(reference):
        return 0.0
    known = set(str(row.get("names") or "").split()) | set(_IDENTIFIER.findall(prompt))
    return 0.0 if undefined_names(fn, known) else 1.0


# --------------------------------------------------------------------------
# Rows from a source file
# --------------------------------------------------------------------------


def module_names(tree: ast.Module) -> set[str]:
    """Names bound at a module's top level (through ``if`` / ``try`` / ``with``
    / ``for`` blocks, not inside functions or classes): what its functions
    may read as globals."""
    out: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue  # their insides are not module scope
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            out.add(node.id)
        elif isinstance(node, ast.alias) and node.name != "*":
            out.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
        stack.extend(ast.iter_child_nodes(node))
    return out


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Module-level functions and the methods of module-level classes, in file order."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    out = [n for n in tree.body if isinstance(n, kinds)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        out += [n for n in cls.body if isinstance(n, kinds)]
    return sorted(out, key=lambda n: n.lineno)


def _alone_on_its_lines(lines: list[str], node: ast.stmt) -> bool:
    """Nothing but whitespace before ``node`` on its first line, and nothing but
    whitespace or a comment after it on its last (``ast`` columns are UTF-8
    byte offsets)."""
    before = lines[node.lineno - 1].encode()[: node.col_offset]
    after = lines[node.end_lineno - 1].encode()[node.end_col_offset:].strip()
    return not before.strip() and (not after or after.startswith(b"#"))


def _head_and_body(lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str] | None:
    """(head: decorators to the docstring's last line, body: the lines after it
    to the function's end), or None when the function has no docstring on
    lines of its own, or nothing after it."""
    doc = fn.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return None
    if len(fn.body) < 2 or doc.lineno == fn.lineno or not _alone_on_its_lines(lines, doc):
        return None
    if fn.body[1].lineno <= doc.end_lineno:  # '"""doc"""; x = 1'
        return None
    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    head, body = "".join(lines[start - 1 : doc.end_lineno]), "".join(lines[doc.end_lineno : fn.end_lineno])
    if not head.endswith("\n") or not body.endswith("\n"):
        return None  # the file ends without a newline inside the function
    return head, body


def _context(lines: list[str], before: int, limit: int) -> str:
    """The longest run of whole lines ending at line ``before`` (exclusive,
    1-based) of at most ``limit`` UTF-8 bytes."""
    out, size = [], 0
    for line in reversed(lines[: before - 1]):
        size += len(line.encode())
        if size > limit:
            break
        out.append(line)
    return "".join(reversed(out))


def function_rows(source: str, path: str, *, context_bytes: int = 256, max_prompt_bytes: int = 384,
                  max_body_bytes: int = 96) -> list[dict]:
    """One row (module docstring above) per qualifying function of
    ``source``, in file order; ``path`` names the file in each row's id. A
    source that does not parse gives no rows. The prompt is the head plus
    as many whole preceding lines as fit in ``context_bytes`` and in
    ``max_prompt_bytes`` together; a head over ``max_prompt_bytes`` or a body
    over ``max_body_bytes`` (UTF-8 bytes) leaves the function out."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = _lines(source)
    names = " ".join(sorted(module_names(tree)))
    rows = []
    for fn in _functions(tree):
        parts = _head_and_body(lines, fn)
        if parts is None:
            continue
        head, body = parts
        head_bytes = len(head.encode())
        if head_bytes > max_prompt_bytes or len(body.encode()) > max_body_bytes:
            continue
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        context = _context(lines, start, min(context_bytes, max_prompt_bytes - head_bytes))
        row = {"prompt": context + head, "head": head, "answer": body, "names": names,
               "id": f"{path}:{fn.lineno}:{fn.name}"}
        if code_complete(row["prompt"], body, row) == 1.0:  # the task is solvable as checked
            rows.append(row)
    return rows


__all__ = ["IMPLICIT_NAMES", "code_complete", "function_rows", "function_text", "module_names", "reads_an_argument",
           "undefined_names"]
