"""Tools a policy can call in a multi-turn rollout, with verl's interface (:class:`.base.BaseTool`) and tool YAML
(:mod:`.registry`); built in: ``calculator`` (:mod:`.calculator`) and ``python`` (a sandboxed interpreter,
:mod:`.python_sandbox`)."""
