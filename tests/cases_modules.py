"""Registry-matrix cases for the module-level transforms: module_replace, fp8 (torchao here), compile."""

from composable_atorch import compile, fp8, module_replace

from matrix import Case

CASES = {
    "module_replace": Case(lambda: module_replace()),
    # torchao runs float8 emulated on the CPU; the tiny GPT's Linear dims are all multiples of 16
    "fp8": Case(lambda: fp8(exclude=("head",))),
    # aot_eager: same graph capture as inductor, no code generation, bitwise equal to eager
    "compile": Case(lambda: compile(backend="aot_eager")),
}
