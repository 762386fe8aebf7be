"""`fe_megatron.megatron.patches.PatchScope`: what a scope replaces is put back when it closes, in reverse
order, also after an exception; scopes nest, and a group an outer scope installed is not installed again."""

import types

import pytest

from fe_megatron.megatron.patches import PatchScope, active, open_scopes


class Base:
    def method(self):
        return "base"


class Owner(Base):
    pass


def test_a_scope_puts_back_what_it_replaced_and_removes_what_it_added():
    module = types.SimpleNamespace(value=1)
    with PatchScope() as scope:
        scope.replace(module, "value", 2)
        scope.replace(Owner, "method", lambda self: "patched")  # inherited: Owner has no method of its own
        scope.replace(module, "added", 3)
        assert module.value == 2 and Owner().method() == "patched" and module.added == 3
    assert module.value == 1 and Owner().method() == "base"
    assert "method" not in vars(Owner) and not hasattr(module, "added")


def test_a_wrapper_around_a_wrapper_restores_the_first_original():
    module = types.SimpleNamespace(save=lambda: ["save"])
    original = module.save
    with PatchScope() as scope:
        first = module.save
        scope.replace(module, "save", lambda: first() + ["seal"])
        second = module.save
        scope.replace(module, "save", lambda: second() + ["hook"])
        assert module.save() == ["save", "seal", "hook"]
    assert module.save is original


def test_everything_is_undone_after_an_exception_in_reverse_order():
    module = types.SimpleNamespace(value=1)
    undone = []
    with pytest.raises(ValueError, match="the run failed"):
        with PatchScope() as scope:
            scope.call_on_exit(lambda: undone.append("registration"))
            scope.replace(module, "value", 2)
            scope.call_on_exit(lambda: undone.append(module.value))  # runs before the value is put back
            raise ValueError("the run failed")
    assert module.value == 1 and undone == [2, "registration"]
    assert open_scopes() == [] or all(scope.name == "process" for scope in open_scopes())


def test_a_group_an_outer_scope_installed_is_a_no_op_inside_and_stays_after_the_inner_scope():
    module = types.SimpleNamespace(value=1)
    installs = []

    def install(scope):
        installs.append(scope.name)
        scope.replace(module, "value", module.value + 1)  # not idempotent: installing twice would show

    with PatchScope("outer") as outer:
        assert outer.install("group", install)
        assert not outer.install("group", install)  # the same scope again
        with PatchScope("inner") as inner:
            assert not inner.install("group", install)
            assert active() is inner
        assert module.value == 2 and installs == ["outer"]
    assert module.value == 1
    with PatchScope("later") as later:  # once the outer scope closed, the group is installed anew
        assert later.install("group", install)
    assert module.value == 1 and installs == ["outer", "later"]


def test_a_closed_scope_refuses_a_patch_it_would_never_undo():
    scope = PatchScope("closed")
    with pytest.raises(RuntimeError, match=r"patch scope 'closed' is not open, so .*value would never be undone"):
        scope.replace(types.SimpleNamespace(value=1), "value", 2)
