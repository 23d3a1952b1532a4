from .budget import MODES, Plan, make_plan, parse_budget
