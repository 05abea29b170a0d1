"""The load-aware tree budget: how many tokens each decoding sequence verifies per round, how
deep its draft goes, and when its cost profile is taken again.

interface  - `BudgetPolicy`, the contract the scheduler and the loop use, and `RoundPlan`
config     - `BudgetConfig`, the budget's frozen settings
cost_model - `CostModel`, seconds of a verify forward and of each draft level, learnt online
search     - `TreeSearch`, the depth x size search over the running prior
guard      - `MeasuredGuard`, measured rates that overrule the model
policy     - `TreeBudget`, the budget the engine serves with
reprofile  - `CostProfiles`, the cost profiles taken and when to take another
"""
from eagle_serve.scheduler.budget.config import BudgetConfig
from eagle_serve.scheduler.budget.cost_model import GROW_FLOOR, CostModel
from eagle_serve.scheduler.budget.interface import BudgetPolicy, RoundPlan
from eagle_serve.scheduler.budget.policy import TreeBudget
from eagle_serve.scheduler.budget.reprofile import CostProfiles, ProfileRun

__all__ = ["BudgetConfig", "BudgetPolicy", "CostModel", "CostProfiles", "GROW_FLOOR", "ProfileRun", "RoundPlan",
           "TreeBudget"]
