"""Checks the built API page (`mkdocs build`'s `api/index.html`, the path given): every
object it documents that is a function at run time is shown as one, with its signature,
not as a module attribute. The Jacobian verbs are bound to what one `_verb` call makes
(`docs/griffe_made_functions.py` documents them from the imported function): this fails
if that stops working."""

import inspect
import re
import sys

import eqxshard

page = open(sys.argv[1], encoding="utf-8").read()
headings = list(re.finditer(r'<h\d id="(eqxshard\.[\w.]+)" class="doc doc-heading">', page))
functions, wrong = [], []
for here in headings:
    obj = eqxshard
    for part in here.group(1).split(".")[1:]:
        obj = getattr(obj, part)
    if not inspect.isfunction(obj):
        continue
    functions.append(here.group(1))
    heading = page[here.end() : page.index("</h", here.end())]
    if "doc-label-module-attribute" in heading:
        wrong.append(here.group(1))
assert "eqxshard.filter_jacrev" in functions, "the API page lost filter_jacrev"
assert not wrong, f"shown as module attributes, not functions: {wrong}"
print(f"API page: {len(functions)} functions, each shown with its signature")
