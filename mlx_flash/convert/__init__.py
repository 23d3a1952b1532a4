from .convert import convert
from .sources import open_source
