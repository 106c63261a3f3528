#!/usr/bin/env python3
"""Writes the demo's chat dataset, capitals.jsonl: one conversation per country, the user asking for
its capital and the assistant answering with the capital's name. Run once; the output is committed.

The conversations are OpenAI-style `messages`: training renders them with the tokenizer's chat template
and supervises the assistant turn (its answer and end-of-turn token), as `spindle generate --chat`
later renders the question."""
import json
import os

CAPITALS = """
Albania Tirana|Algeria Algiers|Argentina Buenos Aires|Armenia Yerevan|Australia Canberra|Austria Vienna
Azerbaijan Baku|Bangladesh Dhaka|Belarus Minsk|Belgium Brussels|Bolivia Sucre|Brazil Brasilia
Bulgaria Sofia|Cambodia Phnom Penh|Canada Ottawa|Chile Santiago|China Beijing|Colombia Bogota
Croatia Zagreb|Cuba Havana|Cyprus Nicosia|Czechia Prague|Denmark Copenhagen|Ecuador Quito
Egypt Cairo|Estonia Tallinn|Ethiopia Addis Ababa|Finland Helsinki|France Paris|Georgia Tbilisi
Germany Berlin|Ghana Accra|Greece Athens|Hungary Budapest|Iceland Reykjavik|India New Delhi
Indonesia Jakarta|Iran Tehran|Iraq Baghdad|Ireland Dublin|Israel Jerusalem|Italy Rome
Jamaica Kingston|Japan Tokyo|Jordan Amman|Kazakhstan Astana|Kenya Nairobi|Latvia Riga
Lebanon Beirut|Lithuania Vilnius|Luxembourg Luxembourg|Malaysia Kuala Lumpur|Mexico Mexico City|Mongolia Ulaanbaatar
Morocco Rabat|Nepal Kathmandu|Netherlands Amsterdam|New Zealand Wellington|Nigeria Abuja|North Korea Pyongyang
Norway Oslo|Pakistan Islamabad|Peru Lima|Philippines Manila|Poland Warsaw|Portugal Lisbon
Qatar Doha|Romania Bucharest|Russia Moscow|Saudi Arabia Riyadh|Senegal Dakar|Serbia Belgrade
Singapore Singapore|Slovakia Bratislava|Slovenia Ljubljana|South Africa Pretoria|South Korea Seoul|Spain Madrid
Sweden Stockholm|Switzerland Bern|Syria Damascus|Thailand Bangkok|Tunisia Tunis|Turkey Ankara
Uganda Kampala|Ukraine Kyiv|United Kingdom London|United States Washington|Uruguay Montevideo|Uzbekistan Tashkent
Venezuela Caracas|Vietnam Hanoi|Zambia Lusaka|Zimbabwe Harare
"""

# Country names of more than one word, so the split below knows where the country ends.
MULTI_WORD_COUNTRIES = {"New Zealand", "North Korea", "Saudi Arabia", "South Africa", "South Korea",
                        "United Kingdom", "United States"}


def pairs():
    for entry in CAPITALS.replace("\n", "|").split("|"):
        entry = entry.strip()
        if not entry:
            continue
        country = next((c for c in MULTI_WORD_COUNTRIES if entry.startswith(c + " ")), entry.split(" ")[0])
        yield country, entry[len(country) + 1:]


def question(country):
    return f"What is the capital of {country}?"


def main():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capitals.jsonl")
    with open(path, "w") as out:
        for country, capital in pairs():
            messages = [{"role": "user", "content": question(country)}, {"role": "assistant", "content": capital}]
            out.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
