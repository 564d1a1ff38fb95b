"""Topic tables behind the sample's ordinary ("filler") records (samples/nemotron_v1.py).

Each split gets its own pool of distinct question/answer pairs: chat (countries, cooking, travel,
a few non-English), stem (elements, organs, planets, SI units), code (tasks in many languages),
math (geometry, probability, algebra word problems, number theory, calculus, statistics; answers
worked out) and tool (weather, currency, calendar, web search, unit conversion, flights, stocks).
Pairs differ in subject, not only in numbers: the similarity filter drops pairs whose question and
answer embeddings are both near another record's (cosine >= 0.9), and "12 x 13" vs "17 x 23"
would be. Topics the crafted records use (nemotron_v1.FACTS, TOOLS) are left out so a filler
record never duplicates a crafted one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Item:
    question: str
    answer: str
    evidence: str  # a context sentence that supports the answer (system-prompt shapes, <think> traces)
    lang: str = "en"


# country, capital, main language (None where another country already has it), landmark, landmark sentence
COUNTRIES = (
    ("France", "Paris", "French", "the Eiffel Tower", "The Eiffel Tower in Paris was completed in 1889 for a world's fair."),
    ("Italy", "Rome", "Italian", "the Colosseum", "The Colosseum in Rome is an ancient amphitheatre that held about 50,000 spectators."),
    ("Japan", "Tokyo", "Japanese", "the Fushimi Inari shrine in Kyoto", "The Fushimi Inari shrine in Kyoto is famous for its thousands of red torii gates."),
    ("Egypt", "Cairo", "Arabic", "the pyramids of Giza", "The pyramids of Giza stand on a desert plateau at the edge of Cairo."),
    ("Brazil", "Brasília", "Portuguese", "the Christ the Redeemer statue", "The Christ the Redeemer statue overlooks Rio de Janeiro from Corcovado mountain."),
    ("Peru", "Lima", None, "Machu Picchu", "Machu Picchu is a 15th-century Inca citadel high in the Andes of Peru."),
    ("India", "New Delhi", None, "the Taj Mahal", "The Taj Mahal in Agra is a white marble mausoleum built in the 17th century."),
    ("Mexico", "Mexico City", "Spanish", "Chichén Itzá", "Chichén Itzá on the Yucatán Peninsula is a Maya city crowned by the El Castillo pyramid."),
    ("Norway", "Oslo", "Norwegian", "the Geirangerfjord", "The Geirangerfjord in western Norway is known for its steep cliffs and waterfalls."),
    ("Turkey", "Ankara", "Turkish", "Hagia Sophia", "Hagia Sophia in Istanbul was built as a cathedral in the sixth century."),
    ("Argentina", "Buenos Aires", None, "the Iguazú Falls", "The Iguazú Falls lie on the border between Argentina and Brazil."),
    ("South Korea", "Seoul", "Korean", "Gyeongbokgung Palace", "Gyeongbokgung Palace in Seoul was the main royal palace of the Joseon dynasty."),
    ("Thailand", "Bangkok", "Thai", "the Grand Palace", "The Grand Palace in Bangkok was the official residence of the kings of Siam from 1782."),
    ("Greece", "Athens", "Greek", "the Acropolis", "The Acropolis of Athens is crowned by the Parthenon, a temple of the goddess Athena."),
    ("Vietnam", "Hanoi", "Vietnamese", "Ha Long Bay", "Ha Long Bay in northern Vietnam is dotted with thousands of limestone islands."),
    ("Portugal", "Lisbon", None, "the Belém Tower", "The Belém Tower in Lisbon is a 16th-century fortification on the Tagus river."),
    ("Kenya", "Nairobi", None, "the Maasai Mara reserve", "The Maasai Mara reserve in Kenya is famous for the yearly wildebeest migration."),
    ("the Netherlands", "Amsterdam", "Dutch", "the Rijksmuseum", "The Rijksmuseum in Amsterdam houses Rembrandt's painting The Night Watch."),
)

COOKING_TRAVEL = (
    Item("How long should I rest a steak after cooking it?", "Let a steak rest for five to ten minutes before you cut it.",
         "Resting a steak for five to ten minutes lets its juices settle back into the meat."),
    Item("How much water do I need to cook white rice on the stove?", "Use about 1.5 to 2 cups of water for every cup of long-grain white rice.",
         "Long-grain white rice cooks in roughly one and a half to two times its volume of water."),
    Item("How do I keep pasta from sticking together?", "Cook pasta in plenty of salted boiling water and stir it during the first two minutes.",
         "Pasta sticks when the pot is too small, so use a large pot of boiling water and stir early."),
    Item("What internal temperature makes chicken safe to eat?", "Chicken is safe to eat once it reaches 74 °C (165 °F) inside.",
         "Food safety agencies recommend cooking chicken to an internal temperature of 74 °C."),
    Item("How can I tell if an avocado is ripe?", "A ripe avocado gives slightly when you press it gently in your palm.",
         "Avocados are ripe when the flesh yields a little to gentle pressure."),
    Item("What can I use instead of eggs in baking?", "A tablespoon of ground flaxseed mixed with three tablespoons of water replaces one egg.",
         "Ground flaxseed soaked in water forms a gel that binds batters the way eggs do."),
    Item("Why does bread dough need kneading?", "Kneading develops gluten, which gives bread its structure and chewy texture.",
         "Kneading the dough stretches and aligns gluten proteins into an elastic network."),
    Item("How do I make a simple vinaigrette?", "Whisk three parts oil with one part vinegar, then season with salt, pepper and a little mustard.",
         "A classic vinaigrette uses three parts oil to one part vinegar."),
    Item("How can I reduce jet lag after a long flight?", "Switch to local time at once: get morning daylight, drink water and avoid long naps.",
         "Daylight in the morning resets the body clock and shortens jet lag."),
    Item("What should I pack in my carry-on bag for a long flight?", "Keep medication, chargers, travel documents, a change of clothes and an empty water bottle in your carry-on.",
         "Essentials such as medicine and passports belong in the carry-on in case checked luggage is delayed."),
    Item("How much liquid can I take through airport security?", "Liquids must be in containers of at most 100 millilitres that fit in one clear one-litre bag.",
         "At most airport security checks, liquids are limited to 100 millilitre containers in a one-litre bag."),
    Item("When is the best time to see the northern lights in Iceland?", "The northern lights are best seen in Iceland from September to March on dark, clear nights.",
         "In Iceland the aurora season runs from September to March, when the nights are long and dark."),
    Item("Is it customary to tip in restaurants in Japan?", "No, tipping is not customary in Japan and can even cause confusion.",
         "In Japan good service is expected without a tip, and staff may return money left on the table."),
    Item("What plug adapter do I need for the United Kingdom?", "The United Kingdom uses Type G plugs with three rectangular pins at 230 volts.",
         "British sockets take the three-pin Type G plug and supply 230 volts."),
)

FOREIGN_CHAT = (
    Item("Wie viele Bundesländer hat Deutschland?", "Deutschland hat 16 Bundesländer.",
         "Die Bundesrepublik Deutschland besteht aus 16 Bundesländern.", "de"),
    Item("Quel fleuve traverse Paris ?", "La Seine traverse Paris.",
         "La Seine traverse Paris avant de se jeter dans la Manche.", "fr"),
    Item("¿En qué ciudad está la Sagrada Familia?", "La Sagrada Familia está en Barcelona.",
         "La basílica de la Sagrada Familia, obra de Antoni Gaudí, se encuentra en Barcelona.", "es"),
    Item("Come si chiama il vulcano vicino a Napoli?", "Il vulcano vicino a Napoli è il Vesuvio.",
         "Il Vesuvio domina il golfo di Napoli e distrusse Pompei nel 79 d.C.", "it"),
)


def chat_items() -> list[Item]:
    out = []
    for country, capital, language, landmark, sentence in COUNTRIES:
        c = country[0].upper() + country[1:]
        out.append(Item(f"What is the capital of {country}?", f"The capital of {country} is {capital}.",
                        f"{capital} is the capital city of {country}."))
        if language:
            out.append(Item(f"What language do people speak in {country}?", f"Most people in {country} speak {language}.",
                            f"The main language of {country} is {language}."))
        out.append(Item(f"What is a famous landmark to visit in {country}?",
                        f"{c} is known for {landmark}, one of its most visited sights.", sentence))
    return out + list(COOKING_TRAVEL) + list(FOREIGN_CHAT)


# name, symbol, atomic number
ELEMENTS = (
    ("oxygen", "O", 8), ("carbon", "C", 6), ("iron", "Fe", 26), ("sodium", "Na", 11), ("helium", "He", 2),
    ("copper", "Cu", 29), ("silver", "Ag", 47), ("neon", "Ne", 10), ("calcium", "Ca", 20), ("uranium", "U", 92),
    ("potassium", "K", 19), ("lead", "Pb", 82), ("mercury", "Hg", 80), ("tin", "Sn", 50),
)
# question, answer, evidence
BIOLOGY_SPACE = (
    ("What does the heart do?", "The heart pumps blood through the blood vessels of the body.",
     "The heart is a muscular organ that pumps blood around the body."),
    ("What is the job of the lungs?", "The lungs take in oxygen and remove carbon dioxide from the blood.",
     "In the lungs, oxygen passes into the blood and carbon dioxide passes out."),
    ("What does the liver do?", "The liver filters the blood, stores glycogen and produces bile.",
     "The liver cleans toxins from the blood and makes bile for digestion."),
    ("What do the kidneys do?", "The kidneys filter waste out of the blood and produce urine.",
     "Each kidney contains about a million nephrons that filter the blood."),
    ("What does the pancreas produce?", "The pancreas produces insulin and digestive enzymes.",
     "The pancreas releases insulin into the blood and enzymes into the small intestine."),
    ("How does the stomach digest food?", "The stomach breaks food down with acid and the enzyme pepsin.",
     "Gastric acid and pepsin in the stomach start the digestion of proteins."),
    ("What is the function of the skin?", "The skin protects the body and helps regulate its temperature.",
     "Skin is the body's largest organ and a barrier against germs and water loss."),
    ("Where are most nutrients absorbed in the body?", "Most nutrients are absorbed in the small intestine.",
     "The small intestine is lined with villi that absorb nutrients from digested food."),
    ("What does the thyroid gland control?", "The thyroid gland makes hormones that control the body's metabolism.",
     "Thyroid hormones set how fast the body's cells use energy."),
    ("Which planet is closest to the Sun?", "Mercury is the planet closest to the Sun.",
     "Mercury orbits the Sun at an average distance of about 58 million kilometres."),
    ("What is the largest planet in the solar system?", "Jupiter is the largest planet in the solar system.",
     "Jupiter is a gas giant more than eleven times as wide as Earth."),
    ("Why does Mars look red?", "Mars looks red because its surface is covered in iron oxide dust.",
     "Rusty iron oxide dust covers much of the surface of Mars."),
    ("Which planet has the most prominent rings?", "Saturn has the most prominent rings, made mostly of ice.",
     "Saturn's rings are made of countless pieces of ice and rock."),
    ("Which planet rotates on its side?", "Uranus rotates on its side, with an axial tilt of about 98 degrees.",
     "Uranus has an axial tilt of about 98 degrees, so it spins nearly on its side."),
    ("How long does sunlight take to reach Earth?", "Sunlight takes about 8 minutes and 20 seconds to reach Earth.",
     "Light from the Sun needs roughly 500 seconds to cross the 150 million kilometres to Earth."),
    ("What is the hottest planet in the solar system?", "Venus is the hottest planet, because its thick atmosphere traps heat.",
     "A runaway greenhouse effect heats the surface of Venus to about 465 °C."),
    ("How many moons does Mars have?", "Mars has two small moons, Phobos and Deimos.",
     "Phobos and Deimos are the two small, irregular moons of Mars."),
    ("What is the Great Red Spot on Jupiter?", "The Great Red Spot is a giant storm on Jupiter that has lasted for centuries.",
     "Jupiter's Great Red Spot is an anticyclonic storm larger than Earth."),
)
# quantity, unit, symbol
SI_UNITS = (
    ("force", "newton", "N"), ("energy", "joule", "J"), ("power", "watt", "W"), ("electric current", "ampere", "A"),
    ("electric charge", "coulomb", "C"), ("pressure", "pascal", "Pa"), ("frequency", "hertz", "Hz"),
    ("electrical resistance", "ohm", "Ω"), ("thermodynamic temperature", "kelvin", "K"),
    ("amount of substance", "mole", "mol"), ("luminous intensity", "candela", "cd"), ("voltage", "volt", "V"),
    ("magnetic flux density", "tesla", "T"),
)


def stem_items() -> list[Item]:
    out = []
    for name, symbol, number in ELEMENTS:
        n = name.capitalize()
        out.append(Item(f"What is the chemical symbol for {name}?", f"The chemical symbol for {name} is {symbol}.",
                        f"In the periodic table, {name} has the symbol {symbol}."))
        out.append(Item(f"What is the atomic number of {name}?", f"{n} has the atomic number {number}.",
                        f"Every {name} atom has {number} protons in its nucleus."))
    out += [Item(q, a, e) for q, a, e in BIOLOGY_SPACE]
    for quantity, unit, symbol in SI_UNITS:
        out.append(Item(f"What is the SI unit of {quantity}?", f"The SI unit of {quantity} is the {unit} ({symbol}).",
                        f"The {unit}, symbol {symbol}, is the SI unit used to measure {quantity}."))
    return out


# language, task (fits "How do I TASK in LANGUAGE?"), answer
CODE_TASKS = (
    ("Python", "sort a dictionary by its values", "Use `dict(sorted(d.items(), key=lambda kv: kv[1]))` to get the dictionary ordered by value."),
    ("Python", "merge two dictionaries", "Write `merged = {**a, **b}` or, from Python 3.9, `a | b`; keys of `b` win."),
    ("Python", "parse a JSON string", "Call `json.loads(text)` from the standard `json` module to get dicts and lists."),
    ("Python", "remove duplicates from a list but keep the order", "`list(dict.fromkeys(items))` keeps the first occurrence of each item in order."),
    ("Python", "get the current date and time", "Call `datetime.now()` from the `datetime` module, or `datetime.now(timezone.utc)` for UTC."),
    ("Python", "make an HTTP GET request", "With the requests library: `r = requests.get(url, timeout=10)`, then `r.json()` or `r.text`."),
    ("Python", "create a virtual environment", "Run `python -m venv .venv` and activate it with `source .venv/bin/activate`."),
    ("Python", "avoid a KeyError when a dictionary key is missing", "Use `d.get(key, default)`, which returns the default instead of raising KeyError."),
    ("Python", "square only the even numbers of a list", "A list comprehension does it: `[x * x for x in nums if x % 2 == 0]`."),
    ("Python", "measure how long a function takes", "Take `time.perf_counter()` before and after the call, or use the `timeit` module."),
    ("Python", "read a CSV file", "Use `csv.DictReader(open(path, newline=''))`, or `pandas.read_csv(path)` for a DataFrame."),
    ("Python", "run code only when the file is executed directly", "Put the code under `if __name__ == \"__main__\":`; it runs when the file is executed directly, not when imported."),
    ("JavaScript", "fetch JSON from an API", "Inside an async function: `const data = await (await fetch(url)).json();`."),
    ("JavaScript", "deep copy an object", "Deep copy an object with `structuredClone(obj)`, available in modern browsers and Node 17+."),
    ("JavaScript", "debounce a function", "Keep a timer: `let t; return (...a) => { clearTimeout(t); t = setTimeout(() => fn(...a), ms); };`."),
    ("JavaScript", "remove duplicate values from an array", "Spread a Set: `[...new Set(arr)]` keeps each value once."),
    ("JavaScript", "run a handler when a button is clicked", "Register it with `button.addEventListener('click', handler)`."),
    ("JavaScript", "format a number as US dollars", "`new Intl.NumberFormat('en-US', {style: 'currency', currency: 'USD'}).format(x)` gives e.g. $1,234.50."),
    ("TypeScript", "describe the shape of an object", "In TypeScript, describe an object's shape with an interface, `interface User { id: number; name: string }`, and annotate values with `: User`."),
    ("SQL", "find the five highest salaries", "`SELECT name, salary FROM employees ORDER BY salary DESC LIMIT 5;`"),
    ("SQL", "count the rows in each group", "`SELECT department, COUNT(*) FROM employees GROUP BY department;` counts rows per department."),
    ("SQL", "join two tables on a key", "`SELECT * FROM orders o JOIN customers c ON o.customer_id = c.id;` returns the matching pairs."),
    ("SQL", "find rows where a column is NULL", "Use `WHERE email IS NULL`; a comparison like `= NULL` never matches."),
    ("SQL", "speed up lookups on a column", "To speed up lookups on a column, index it: `CREATE INDEX idx_users_email ON users (email);`."),
    ("Bash", "find files larger than 100 MB", "`find . -type f -size +100M` lists them below the current directory."),
    ("Bash", "count the lines of a file", "`wc -l file.txt` prints the number of lines."),
    ("Bash", "replace a word in a file", "`sed -i 's/old/new/g' file.txt` replaces every occurrence in place."),
    ("Bash", "see which process listens on port 8080", "`ss -ltnp | grep :8080` (or `lsof -i :8080`) shows the listening process."),
    ("Bash", "make a script executable", "Run `chmod +x script.sh`, then start it with `./script.sh`."),
    ("Java", "convert a string to an int", "`Integer.parseInt(\"42\")` returns 42 and throws NumberFormatException on bad input."),
    ("Java", "sort a list of strings alphabetically", "`Collections.sort(names)` sorts the list in place in natural order."),
    ("Go", "run a function concurrently", "Start a goroutine by putting `go` before the call: `go worker(jobs)`."),
    ("Go", "handle errors", "Functions return an `error` value; check it with `if err != nil { return err }`."),
    ("Go", "read a whole file into memory", "In Go, `data, err := os.ReadFile(\"config.json\")` reads the whole file into memory."),
    ("Rust", "read a line from standard input", "`let mut s = String::new(); std::io::stdin().read_line(&mut s)?;`"),
    ("Rust", "define a struct with a method", "Declare `struct Point { x: f64, y: f64 }` and add methods in an `impl Point` block."),
    ("C", "allocate an array on the heap", "`int *a = malloc(n * sizeof *a);` and release it with `free(a)` when done."),
    ("C++", "iterate over a std::map", "With C++17 structured bindings: `for (const auto& [key, value] : m) { ... }`."),
    ("pandas", "sum a column per group", "`df.groupby('region')['sales'].sum()` gives total sales per region."),
    ("pandas", "drop rows with missing values", "`df.dropna()` removes rows with any missing value; pass `subset=[...]` to check some columns."),
    ("git", "undo the last commit but keep its changes", "`git reset --soft HEAD~1` moves the branch back and keeps the changes staged."),
    ("git", "see the changes staged for the next commit", "`git diff --staged` shows them."),
    ("Docker", "list running containers", "`docker ps` lists running containers; add `-a` to include stopped ones."),
    ("a regular expression", "match a five-digit ZIP code", "`^\\d{5}$` matches exactly five digits; `^\\d{5}(-\\d{4})?$` also allows ZIP+4."),
    ("Kotlin", "declare a variable that can be null", "Add `?` to the type, `var name: String? = null`, and read it with `?.` or `?:`."),
    ("R", "compute the mean of a column that has NA values", "`mean(df$price, na.rm = TRUE)` ignores the missing values."),
    ("CSS", "center an element horizontally and vertically", "Give the parent `display: flex; justify-content: center; align-items: center;`."),
)
CODE_QUESTIONS = ("How do I {task} in {lang}?", "In {lang}, how can I {task}?", "What is the {lang} way to {task}?")


def code_items(pick) -> list[Item]:
    """`pick(seq)` chooses the question wording (the caller's seeded RNG)."""
    out = []
    for lang, task, answer in CODE_TASKS:
        q = pick(CODE_QUESTIONS).format(task=task, lang=lang)
        out.append(Item(q, answer, f"The {lang} documentation explains how to {task}."))
    return out


# question, answer (worked out), evidence (the rule used)
MATH = (
    ("What is the area of a rectangle 8 m long and 5 m wide?", "The rectangle's area is 8 × 5 = 40 square metres.",
     "The area of a rectangle is its length times its width."),
    ("What is the circumference of a circle with a diameter of 10 cm?", "The circumference is 10π ≈ 31.42 cm.",
     "A circle's circumference is π times its diameter."),
    ("What is the area of a triangle with base 6 cm and height 4 cm?", "The triangle's area is ½ × 6 × 4 = 12 cm².",
     "The area of a triangle is half its base times its height."),
    ("What is the volume of a cube with 3 cm sides?", "The cube's volume is 3³ = 27 cm³.",
     "A cube's volume is its side length cubed."),
    ("How long is the hypotenuse of a right triangle with legs 3 and 4?", "By Pythagoras the hypotenuse is √(9 + 16) = 5.",
     "In a right triangle the square of the hypotenuse equals the sum of the squares of the legs."),
    ("What do the interior angles of a hexagon add up to?", "A hexagon's interior angles add up to (6 − 2) × 180 = 720 degrees.",
     "The interior angles of a polygon with n sides sum to (n − 2) × 180 degrees."),
    ("What is the volume of a cylinder with radius 2 m and height 5 m?", "The cylinder holds π × 2² × 5 = 20π ≈ 62.83 m³.",
     "A cylinder's volume is π times the radius squared times the height."),
    ("What is the surface area of a sphere with radius 3 cm?", "The sphere's surface area is 4π × 3² = 36π ≈ 113.10 cm².",
     "The surface area of a sphere is four π times the radius squared."),
    ("What is the perimeter of a square with 7 cm sides?", "The square's perimeter is 4 × 7 = 28 cm.",
     "A square's perimeter is four times its side."),
    ("What is the slope of the line through (1, 2) and (3, 8)?", "The slope is (8 − 2) / (3 − 1) = 3.",
     "The slope of a line is the change in y divided by the change in x."),
    ("How far apart are the points (0, 0) and (6, 8)?", "The distance between the points is √(36 + 64) = 10.",
     "The distance between two points follows from the Pythagorean theorem."),
    ("What is the probability of rolling a sum of 7 with two dice?", "Six of the 36 outcomes sum to 7, so the probability is 1/6.",
     "Two dice have 36 equally likely outcomes."),
    ("If I flip a fair coin three times, what is the chance of three heads?", "The chance of three heads is (1/2)³ = 1/8.",
     "Independent coin flips multiply their probabilities."),
    ("What is the probability of drawing an ace from a 52-card deck?", "There are 4 aces in 52 cards, so the probability is 4/52 = 1/13.",
     "A standard deck of 52 cards has four aces."),
    ("A bag has 3 red and 5 blue marbles. What is the probability of picking a red one?", "Three of the eight marbles are red, so the probability is 3/8.",
     "The probability of an outcome is favourable cases over all cases."),
    ("What is the chance of at least one six in two rolls of a die?", "The chance of at least one six in two rolls is 1 − (5/6)² = 11/36, about 30.6%.",
     "The chance of at least one success is one minus the chance of none."),
    ("In how many ways can 5 books be arranged on a shelf?", "Five books can be arranged in 5! = 120 ways.",
     "n distinct objects can be ordered in n factorial ways."),
    ("How many ways are there to choose 2 people from a group of 6?", "There are C(6, 2) = 15 ways to choose the pair.",
     "Choosing k of n items without order gives the binomial coefficient n choose k."),
    ("Solve for x: 3x + 7 = 22.", "Subtracting 7 gives 3x = 15, so x = 5.",
     "To solve a linear equation, isolate x on one side."),
    ("A train travels 360 km in 4 hours. What is its average speed?", "The train's average speed is 360 / 4 = 90 km/h.",
     "Average speed is distance divided by time."),
    ("A shirt costs $40 and is 25% off. What is the sale price?", "25% of $40 is $10, so the shirt costs $30 on sale.",
     "A discount of p percent removes p hundredths of the price."),
    ("Maria is twice as old as her brother and together they are 36. How old is Maria?", "Her brother is 12 (3 × 12 = 36), so Maria is 24.",
     "Write the brother's age as b, so b + 2b = 36."),
    ("If 4 notebooks cost $10, how much do 10 notebooks cost?", "One notebook costs $2.50, so ten notebooks cost $25.",
     "Find the unit price first, then scale it."),
    ("What is the simple interest on $2,000 at 5% a year for 3 years?", "The simple interest is 2,000 × 0.05 × 3 = $300.",
     "Simple interest is principal times rate times time."),
    ("Solve the system x + y = 10 and x − y = 4.", "Adding the equations gives 2x = 14, so x = 7 and y = 3.",
     "Adding two equations can eliminate a variable."),
    ("What are the roots of x² − 5x + 6 = 0?", "The quadratic factors as (x − 2)(x − 3), so x = 2 or x = 3.",
     "A quadratic can be solved by factoring it into two linear terms."),
    ("A recipe needs 3 eggs for 12 cookies. How many eggs are needed for 36 cookies?", "36 cookies are three batches, so you need 9 eggs.",
     "Ingredients scale in proportion to the number of servings."),
    ("Two pipes fill a tank alone in 6 hours and 3 hours. How long do they take together?", "Together they fill 1/6 + 1/3 = 1/2 of the tank per hour, so 2 hours.",
     "Work rates add when two workers share a job."),
    ("A colony of 1,000 bacteria doubles every hour. How many bacteria are there after 5 hours?", "After five doublings there are 1,000 × 2⁵ = 32,000 bacteria.",
     "Exponential growth multiplies by the same factor each period."),
    ("What is 15% of 240?", "15% of 240 is 0.15 × 240 = 36.", "A percentage of a number is that number times the percentage over 100."),
    ("A car uses 6 litres of fuel per 100 km. How much fuel does it need for 350 km?", "The car needs 6 × 3.5 = 21 litres of fuel for 350 km.",
     "Fuel use scales with distance."),
    ("What is the greatest common divisor of 48 and 180?", "The greatest common divisor of 48 and 180 is 12.",
     "48 = 2⁴ × 3 and 180 = 2² × 3² × 5 share the factors 2² × 3."),
    ("What is the least common multiple of 8 and 12?", "The least common multiple of 8 and 12 is 24.",
     "The least common multiple is the smallest number both divide."),
    ("Is 91 a prime number?", "No, 91 is not prime: 91 = 7 × 13.", "A prime number has no divisors other than 1 and itself."),
    ("What is 10 factorial?", "10! = 3,628,800.", "n factorial is the product of all integers from 1 to n."),
    ("What is 45 written in binary?", "45 in binary is 101101 (32 + 8 + 4 + 1).", "Binary writes a number as a sum of powers of two."),
    ("What is the remainder when 100 is divided by 7?", "100 = 7 × 14 + 2, so the remainder is 2.",
     "Division with remainder writes a = q × b + r with 0 ≤ r < b."),
    ("What is the derivative of sin(x)?", "The derivative of sin(x) is cos(x).", "The sine function differentiates to the cosine."),
    ("What is the integral of x² from 0 to 3?", "The antiderivative is x³/3, so the integral from 0 to 3 is 27/3 = 9.",
     "A definite integral is the antiderivative evaluated at the bounds."),
    ("What is the limit of sin(x)/x as x approaches 0?", "The limit of sin(x)/x as x approaches 0 is 1.",
     "Near zero, sin(x) is approximately x."),
    ("What is the derivative of e^(2x)?", "By the chain rule, the derivative of e^(2x) is 2e^(2x).",
     "The chain rule multiplies by the derivative of the inner function."),
    ("What is the mean of 4, 8, 15, 16 and 23?", "The mean is (4 + 8 + 15 + 16 + 23) / 5 = 66 / 5 = 13.2.",
     "The mean is the sum of the values divided by how many there are."),
    ("What is the median of 3, 9, 1, 7 and 5?", "Sorted, the values are 1, 3, 5, 7, 9, so the median is 5.",
     "The median is the middle value of the sorted list."),
    ("What is the expected value of a roll of a fair six-sided die?", "The expected value of a die roll is (1 + 2 + 3 + 4 + 5 + 6) / 6 = 3.5.",
     "An expected value weights each outcome by its probability."),
    ("What is log base 2 of 1024?", "Since 2¹⁰ = 1024, log base 2 of 1024 is 10.", "A logarithm asks which power of the base gives the number."),
    ("How do I write 3/8 as a decimal?", "3/8 as a decimal is 0.375.", "Dividing the numerator by the denominator gives the decimal."),
    ("What is the next number in the sequence 2, 6, 18, 54?", "Each term triples, so the next number in the sequence is 162.",
     "A geometric sequence multiplies each term by the same ratio."),
)


def math_items() -> list[Item]:
    return [Item(q, a, e) for q, a, e in MATH]


# ----------------------------------------------------------------------------- tools
def _tool(name: str, description: str, question: str, arguments: dict, result: Any, answer: str) -> dict[str, Any]:
    return {"name": name, "description": description, "question": question, "arguments": arguments,
            "result": result, "answer": answer}


WEATHER = (  # city, °C, conditions
    ("Tokyo", 24, "sunny skies"), ("Oslo", -3, "light snow"), ("Cairo", 31, "clear skies"), ("Lima", 19, "overcast skies"),
    ("Toronto", 12, "strong wind"), ("Sydney", 22, "a few clouds"), ("Mumbai", 30, "thunderstorms"), ("Reykjavik", 5, "drizzle"),
)
CURRENCIES = {"GBP": "British pounds", "JPY": "Japanese yen", "EUR": "euros", "CHF": "Swiss francs", "CAD": "Canadian dollars",
              "MXN": "Mexican pesos", "AUD": "Australian dollars", "NZD": "New Zealand dollars", "INR": "Indian rupees",
              "USD": "US dollars", "BRL": "Brazilian reais", "SEK": "Swedish kronor"}
CONVERSIONS = (  # amount, from, to, rate
    (250, "GBP", "JPY", 190.5), (1000, "JPY", "USD", 0.0067), (75, "EUR", "CHF", 0.94), (500, "CAD", "MXN", 13.2),
    (60, "AUD", "NZD", 1.09), (2000, "INR", "EUR", 0.011), (120, "USD", "BRL", 5.4), (40, "CHF", "SEK", 12.1),
)
EVENTS = (  # title, ISO date, spoken date, time
    ("Dentist appointment", "2025-06-12", "12 June", "09:30"), ("Team retrospective", "2025-03-04", "4 March", "15:00"),
    ("Birthday dinner with Mum", "2025-08-21", "21 August", "19:30"), ("Car service", "2025-04-09", "9 April", "08:00"),
    ("Yoga class", "2025-02-17", "17 February", "18:15"), ("Parent-teacher meeting", "2025-10-02", "2 October", "16:45"),
)
AGENDAS = (  # ISO date, spoken date, events
    ("2025-05-05", "Monday 5 May", [("10:00", "Budget review"), ("13:00", "Lunch with Priya")]),
    ("2025-09-19", "Friday 19 September", [("08:30", "Gym"), ("17:00", "Pick up the kids")]),
    ("2025-11-11", "Tuesday 11 November", []),
)
SEARCHES = (  # query, snippet, answer
    ("opening hours of the Louvre", "The Louvre is open from 9 a.m. to 6 p.m. and closed on Tuesdays.",
     "The Louvre opens at 9 a.m. and closes at 6 p.m.; it is closed on Tuesdays."),
    ("who won the 2018 FIFA World Cup", "France beat Croatia 4-2 in the 2018 FIFA World Cup final in Moscow.",
     "France won the 2018 World Cup, beating Croatia 4-2 in the final."),
    ("how tall is the Burj Khalifa", "The Burj Khalifa in Dubai is 828 metres tall.", "The Burj Khalifa is 828 metres tall."),
    ("when was the first iPhone released", "Apple released the first iPhone in the United States on 29 June 2007.",
     "The first iPhone went on sale on 29 June 2007."),
    ("boiling point of ethanol", "Ethanol boils at 78.37 °C at standard atmospheric pressure.",
     "Ethanol boils at about 78.4 °C at normal pressure."),
    ("who painted The Starry Night", "The Starry Night is an 1889 oil painting by Vincent van Gogh.",
     "Vincent van Gogh painted The Starry Night in 1889."),
    ("length of the Amazon river", "The Amazon river is roughly 6,400 kilometres long.", "The Amazon is about 6,400 km long."),
    ("how many players are on a basketball team on court", "Each basketball team has five players on the court.",
     "A basketball team has five players on the court at a time."),
)
UNITS = (  # value, from, to, factor or function
    (26.2, "miles", "kilometres", lambda v: v * 1.609344), (180, "centimetres", "feet", lambda v: v / 30.48),
    (5, "kilograms", "pounds", lambda v: v * 2.20462262), (350, "degrees Fahrenheit", "degrees Celsius", lambda v: (v - 32) * 5 / 9),
    (2, "US cups", "millilitres", lambda v: v * 236.5882365), (10, "US gallons", "litres", lambda v: v * 3.785411784),
    (100, "kilometres per hour", "miles per hour", lambda v: v / 1.609344), (3, "acres", "square metres", lambda v: v * 4046.8564224),
)
FLIGHTS = (  # from, to, spoken route, date, spoken date, number, departs, price
    ("LHR", "JFK", "London to New York", "2025-09-14", "14 September", "BA 117", "08:25", 412),
    ("MAD", "LIS", "Madrid to Lisbon", "2025-06-01", "1 June", "TP 1015", "13:40", 89),
    ("SIN", "HND", "Singapore to Tokyo", "2025-11-20", "20 November", "SQ 634", "22:35", 530),
)
STOCKS = (("MSFT", "Microsoft", 415.2), ("TSLA", "Tesla", 248.9), ("NVDA", "Nvidia", 121.4))


def tool_cases() -> list[dict[str, Any]]:
    out = []
    for city, temp, cond in WEATHER:
        out.append(_tool("get_weather", "Current weather for a city", f"What's the weather like in {city} right now?",
                         {"city": city, "unit": "celsius"}, {"city": city, "temperature_c": temp, "conditions": cond},
                         f"It is {temp} °C in {city} with {cond} right now."))
    for amount, src, dst, rate in CONVERSIONS:
        value = round(amount * rate, 2)
        out.append(_tool("convert_currency", "Convert an amount between currencies",
                         f"How much is {amount:,} {CURRENCIES[src]} in {CURRENCIES[dst]}?",
                         {"amount": amount, "from": src, "to": dst}, {"amount": value, "currency": dst, "rate": rate},
                         f"{amount:,} {CURRENCIES[src]} is about {value:,.2f} {CURRENCIES[dst]} at a rate of {rate}."))
    for i, (title, iso, spoken, time) in enumerate(EVENTS):
        out.append(_tool("create_calendar_event", "Add an event to the user's calendar",
                         f"Put '{title}' in my calendar on {spoken} at {time}.", {"title": title, "date": iso, "time": time},
                         {"event_id": f"evt_{i + 101}", "status": "created"},
                         f"Done: '{title}' is in your calendar for {spoken} at {time}."))
    for iso, spoken, events in AGENDAS:
        listed = "; ".join(f"{t} {name}" for t, name in events)
        out.append(_tool("list_calendar_events", "Events in the user's calendar on a date",
                         f"What do I have planned on {spoken}?", {"date": iso},
                         {"date": iso, "events": [{"time": t, "title": name} for t, name in events]},
                         f"On {spoken} you have: {listed}." if events else f"Your calendar is free on {spoken}."))
    for query, snippet, answer in SEARCHES:
        out.append(_tool("web_search", "Search the web and return the top results", f"Can you look up {query}?",
                         {"query": query, "max_results": 1}, {"results": [{"snippet": snippet}]}, answer))
    for value, src, dst, fn in UNITS:
        res = round(fn(value), 2)
        out.append(_tool("convert_units", "Convert a value between units of measurement", f"How many {dst} is {value} {src}?",
                         {"value": value, "from_unit": src, "to_unit": dst}, {"value": res, "unit": dst},
                         f"{value} {src} is about {res:,} {dst}."))
    for src, dst, route, iso, spoken, number, departs, price in FLIGHTS:
        out.append(_tool("search_flights", "Find flights between two airports on a date",
                         f"Find me a flight from {route} on {spoken}.", {"from": src, "to": dst, "date": iso},
                         {"flights": [{"number": number, "departs": departs, "price_eur": price}]},
                         f"Flight {number} from {route} on {spoken} departs at {departs} and costs {price} euros."))
    for ticker, company, price in STOCKS:
        out.append(_tool("get_stock_price", "Latest stock price for a ticker", f"What is {company}'s share price today?",
                         {"ticker": ticker}, {"ticker": ticker, "price_usd": price},
                         f"{company} ({ticker}) is trading at {price:.2f} US dollars."))
    return out


def tool_result(case: dict[str, Any]) -> str:
    return json.dumps(case["result"], ensure_ascii=False)

# Extra noise for filler system prompts (nemotron_v1.IRRELEVANT stays as the crafted records use it).
NOISE = (
    "The quarterly newsletter goes out next week.",
    "Visitors must sign in at the front desk.",
    "The elevator in building B is under maintenance.",
    "Lost and found items are kept for thirty days.",
)
