"""The active policy and controller settings: read freely, change with the bearer token."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api.deps import AdminDep, AppState, StateDep
from expertmesh.controller.core import ControllerSettings
from expertmesh.planner import available_policies

router = APIRouter(prefix="/policy", tags=["policy"])


def _out(state: AppState) -> s.PolicyOut:
    cur = state.core.settings
    return s.PolicyOut(
        policy=cur.policy,
        policy_settings=dict(cur.policy_settings),
        trigger=cur.trigger,
        window=cur.window,
        available=available_policies(),
    )


@router.get("", response_model=s.PolicyOut, summary="The active policy and settings")
def get_policy(state: StateDep) -> s.PolicyOut:
    return _out(state)


@router.put(
    "",
    response_model=s.PolicyOut,
    summary="Switch policy / settings (bearer token)",
    responses={401: {"model": s.ErrorOut}, 403: {"model": s.ErrorOut}, 422: {"model": s.ErrorOut}},
)
def put_policy(state: StateDep, body: s.PolicyIn, _auth: AdminDep) -> s.PolicyOut:
    cur = state.core.settings
    try:
        new = ControllerSettings.model_validate(  # the fields the body leaves out stay
            cur.model_dump()
            | {
                "policy": body.policy,
                "policy_settings": body.policy_settings,
                "trigger": body.trigger or cur.trigger,
                "window": body.window or cur.window,
            }
        )
        state.core.configure(new)
    except ValueError as err:
        raise HTTPException(422, str(err)) from None
    state.store.save_settings(new)
    return _out(state)
