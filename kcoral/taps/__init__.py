"""The services of the twistd plugins and of the kcoral command, each assembled
from the components it runs."""
